#include "shim/curl_api.hpp"

#include <dlfcn.h>

#include <cerrno>
#include <memory>
#include <mutex>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "hbmio/error.hpp"
#include "shim/dl.hpp"

namespace hbmio::shim {
namespace {

CurlApi load_curl() {
  std::vector<std::string> failures;
  void* handle = open_library("libcurl.so.4", "HBMIO_CURL_LIBRARY", failures);
  if (handle == nullptr)
    throw Error(errno_code(ENOENT), {.op = "load libcurl"},
                fmt::format("remote URLs need libcurl ({}); install it (Debian: libcurl4) or set HBMIO_CURL_LIBRARY",
                            fmt::join(failures, "; ")));
  CurlApi api;
  api.global_init = required_symbol<CurlApi::GlobalInit>(handle, "curl_global_init", "load libcurl");
  api.easy_init = required_symbol<CurlApi::EasyInit>(handle, "curl_easy_init", "load libcurl");
  api.easy_cleanup = required_symbol<CurlApi::EasyCleanup>(handle, "curl_easy_cleanup", "load libcurl");
  api.easy_reset = required_symbol<CurlApi::EasyReset>(handle, "curl_easy_reset", "load libcurl");
  api.easy_setopt = required_symbol<CurlApi::EasySetopt>(handle, "curl_easy_setopt", "load libcurl");
  api.easy_getinfo = required_symbol<CurlApi::EasyGetinfo>(handle, "curl_easy_getinfo", "load libcurl");
  api.easy_perform = required_symbol<CurlApi::EasyPerform>(handle, "curl_easy_perform", "load libcurl");
  api.easy_strerror = required_symbol<CurlApi::EasyStrerror>(handle, "curl_easy_strerror", "load libcurl");
  api.slist_append = required_symbol<CurlApi::SlistAppend>(handle, "curl_slist_append", "load libcurl");
  api.slist_free_all = required_symbol<CurlApi::SlistFreeAll>(handle, "curl_slist_free_all", "load libcurl");
  api.version_info = required_symbol<CurlApi::VersionInfo>(handle, "curl_version_info", "load libcurl");
  api.library = loaded_file(handle, "libcurl.so.4");
  const curl_version_info_data* info = api.version_info(CURLVERSION_NOW);
  api.version = info && info->version ? info->version : "?";
  if (info == nullptr || info->version_num < 0x074b00)
    throw Error(errno_code(ENOSYS), {.op = "load libcurl"},
                fmt::format("{} is libcurl {}; S3 signing needs 7.75 or later", api.library, api.version));
  // Once per process, before any handle, as libcurl asks (it is not thread-safe in older versions).
  if (const CURLcode rc = api.global_init(CURL_GLOBAL_DEFAULT); rc != CURLE_OK)
    throw Error(errno_code(EIO), {.op = "load libcurl"}, fmt::format("curl_global_init: {}", api.easy_strerror(rc)));
  return api;
}

}  // namespace

const CurlApi& curl_api() {
  // A failed load is retried at the next call (and says why again), as for NCCL.
  static std::mutex mutex;
  static std::unique_ptr<CurlApi> api;
  std::lock_guard lock(mutex);
  if (!api) api = std::make_unique<CurlApi>(load_curl());
  return *api;
}

}  // namespace hbmio::shim
