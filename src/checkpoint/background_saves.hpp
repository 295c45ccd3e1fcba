// The background saves in flight, by the path they replace (async_save.cpp): one save per path at
// a time, so that an older state never publishes after a newer one.
#pragma once

#include <atomic>
#include <memory>
#include <string>

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

// A load of `path` (a file, a sharded checkpoint's directory or its index) started while this
// process saves it in the background reads what that save publishes: it waits for the background
// saves in flight whose target is `path` or the directory holding it (read your own writes, as
// after write(2)). A failed save leaves the file as it was; its error stays for its wait(). Blocking
// saves are not waited for (another thread's load meanwhile reads whichever file is there), nor is
// a save from the thread that persists it.
void wait_for_background_saves_of(const std::string& path);

}  // namespace hbmio::detail
