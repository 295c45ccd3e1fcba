#include "shim/dl.hpp"

#include <dlfcn.h>
#include <link.h>  // struct link_map, for dlinfo(RTLD_DI_LINKMAP)

#include <cerrno>
#include <utility>

#include <fmt/format.h>

#include "hbmio/config.hpp"
#include "hbmio/error.hpp"

namespace hbmio::shim {

std::string loaded_file(void* handle, const std::string& fallback) {
  link_map* map = nullptr;
  if (::dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr && map->l_name[0] != '\0')
    return map->l_name;
  return fallback;
}

std::string dl_failure(const std::string& path, const char* error) {
  std::string text = error ? error : "dlopen failed without a message";
  if (text.rfind(path, 0) != 0) text = path + ": " + text;
  return text;
}

void* open_library(const std::string& soname, const char* env_variable, std::vector<std::string>& failures) {
  if (void* handle = ::dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD)) return handle;
  failures.push_back(soname + " is not loaded in this process");
  std::vector<std::string> candidates;
  if (std::string path = configured_library(env_variable); !path.empty()) candidates.push_back(std::move(path));
  candidates.push_back(soname);
  for (const auto& candidate : candidates) {
    ::dlerror();
    if (void* handle = ::dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL)) return handle;
    failures.push_back(dl_failure(candidate, ::dlerror()));
  }
  return nullptr;
}

void missing_symbol(const char* name, const char* op) {
  throw Error(errno_code(ENOSYS), {.op = op}, fmt::format("the library has no {}", name));
}

}  // namespace hbmio::shim
