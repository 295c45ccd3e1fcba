// What the run-time loaders of optional libraries (cuFile, NCCL) share.
#pragma once

#include <string>

namespace hbmio::shim {

// The file a dlopen() handle came from (as the dynamic linker resolved it), or `fallback`.
std::string loaded_file(void* handle, const std::string& fallback);

// dlerror() usually starts with the path it tried; the path is added only when it does not, so
// each entry of a load error names its candidate exactly once.
std::string dl_failure(const std::string& path, const char* error);

}  // namespace hbmio::shim
