// The background saves in flight, by the path they replace (async_save.cpp): one save per path at
// a time, so that an older state never publishes after a newer one.
#pragma once

#include <string>

namespace hbmio::detail {

// Waits while a background save of `target` (a path as check_save returns it) is in flight: what
// a blocking save of the same path does before it persists.
void wait_for_background_save(const std::string& target);

}  // namespace hbmio::detail
