#include "shim/dl.hpp"

#include <dlfcn.h>
#include <link.h>  // struct link_map, for dlinfo(RTLD_DI_LINKMAP)

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

}  // namespace hbmio::shim
