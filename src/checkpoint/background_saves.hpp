// The background saves in flight, by the path they replace (async_save.cpp): one save per path at
// a time, so that an older state never publishes after a newer one.
#pragma once

#include <memory>
#include <string>

namespace hbmio::detail {

struct AsyncSaveState;

// A blocking save's turn at its target (a path as check_save returns it), for as long as it lives:
// it waits for a background save of the target still in flight (and raises the error of one that
// failed unseen), and a background save started meanwhile waits for it in turn.
class BlockingSaveTurn {
 public:
  BlockingSaveTurn(const std::string& target, const std::string& path);
  ~BlockingSaveTurn();
  BlockingSaveTurn(const BlockingSaveTurn&) = delete;
  BlockingSaveTurn& operator=(const BlockingSaveTurn&) = delete;

 private:
  std::shared_ptr<AsyncSaveState> state_;
};

}  // namespace hbmio::detail
