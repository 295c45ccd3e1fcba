// What the run-time loaders of optional libraries (cuFile, NCCL) share.
#pragma once

#include <dlfcn.h>

#include <string>
#include <vector>

namespace hbmio::shim {

// The file a dlopen() handle came from (as the dynamic linker resolved it), or `fallback`.
std::string loaded_file(void* handle, const std::string& fallback);

// dlerror() usually starts with the path it tried; the path is added only when it does not, so
// each entry of a load error names its candidate exactly once.
std::string dl_failure(const std::string& path, const char* error);

// The caller's library as NCCL and libcurl are looked up: the copy of `soname` already loaded in
// the process, else the file named by $`env_variable`, else `soname` on the linker's search path
// (RTLD_LOCAL: its symbols must not interpose on another copy loaded later). Null when none
// loads; `failures` then says why for each place tried.
void* open_library(const std::string& soname, const char* env_variable, std::vector<std::string>& failures);

// `name` from a dlopen() handle, as `Fn` (POSIX: a dlsym() result converts to a function
// pointer); an Error (ENOSYS, operation `op`) naming it when the library lacks it.
[[noreturn]] void missing_symbol(const char* name, const char* op);
template <class Fn>
Fn required_symbol(void* handle, const char* name, const char* op) {
  auto fn = reinterpret_cast<Fn>(::dlsym(handle, name));
  if (fn == nullptr) missing_symbol(name, op);
  return fn;
}

}  // namespace hbmio::shim
