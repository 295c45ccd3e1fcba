// The background saves in flight, by the path they replace (async_save.cpp): one save per path at
// a time, so that an older state never publishes after a newer one.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

namespace hbmio::detail {

struct AsyncSaveState;

// A blocking save's turn at its target (a path as check_save returns it), for as long as it lives:
// it waits for a background save of the target still in flight (and raises the error of one that
// failed unseen), and a background save started meanwhile waits for it in turn. `cancel` (the
// save's stop request, may be null) ends the wait with Error(ECANCELED).
class BlockingSaveTurn {
 public:
  BlockingSaveTurn(const std::string& target, const std::string& path, const std::atomic<bool>* cancel);
  ~BlockingSaveTurn();
  BlockingSaveTurn(const BlockingSaveTurn&) = delete;
  BlockingSaveTurn& operator=(const BlockingSaveTurn&) = delete;

 private:
  std::shared_ptr<AsyncSaveState> state_;
};

// Loads read this process's own saves: a load started while this process saves what it opens in
// the background reads what that save publishes (read your own writes, as after write(2)). This
// waits for the background saves in flight whose target is one of `paths` (as a save follows it:
// a link at the end followed) or the directory holding one (a sharded save's target, when its
// index or a shard is opened); true if it waited. A failed save leaves the file as it was; its
// error stays for its wait(). Blocking saves are not waited for (another thread's load meanwhile
// reads whichever file is there), nor a save by the thread persisting it.
bool wait_for_background_saves_of(const std::vector<std::string>& paths);

}  // namespace hbmio::detail
