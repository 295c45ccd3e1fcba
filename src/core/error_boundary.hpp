// The one place where exceptions of the standard library become hbmio::Error. Public calls run
// their bodies through errors_as_hbmio(), so every error leaving the library is an Error with
// its context (and Python raises hbmio.Error, not RuntimeError), whatever raised it inside:
// std::filesystem, thread creation, allocation.
#pragma once

#include <filesystem>
#include <new>
#include <string>
#include <system_error>
#include <utility>

#include "hbmio/error.hpp"

namespace hbmio::detail {

template <class F>
decltype(auto) errors_as_hbmio(const ErrorContext& context, F&& body) {
  try {
    return std::forward<F>(body)();
  } catch (const Error&) {
    throw;
  } catch (const std::filesystem::filesystem_error& e) {
    ErrorContext c = context;
    if (!e.path1().empty()) c.path = e.path1().string();
    std::string detail = e.what();  // "filesystem error: cannot ...: reason [path]"
    if (detail.rfind("filesystem error: ", 0) == 0) detail.erase(0, 18);
    throw Error(e.code(), c, detail);
  } catch (const std::system_error& e) {
    throw Error(e.code(), context, e.what());
  } catch (const std::bad_alloc&) {
    throw Error(errno_code(ENOMEM), context, "out of memory");
  }
}

}  // namespace hbmio::detail
