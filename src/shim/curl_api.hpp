// libcurl's entry points, loaded at run time.
//
// Why dlopen: remote URLs are one feature among many, and a machine without libcurl (a minimal
// GPU image) must still load and save local checkpoints. The types and constants are curl.h's
// own (libcurl's ABI, soname libcurl.so.4, has been stable since 2006); only the functions are
// looked up: the copy already loaded in the process, else $HBMIO_CURL_LIBRARY, else libcurl.so.4.
#pragma once

#include <string>

#include <curl/curl.h>

namespace hbmio::shim {

struct CurlApi {
  using GlobalInit = CURLcode (*)(long);
  using EasyInit = CURL* (*)();
  using EasyCleanup = void (*)(CURL*);
  using EasyReset = void (*)(CURL*);
  using EasySetopt = CURLcode (*)(CURL*, CURLoption, ...);
  using EasyGetinfo = CURLcode (*)(CURL*, CURLINFO, ...);
  using EasyPerform = CURLcode (*)(CURL*);
  using EasyStrerror = const char* (*)(CURLcode);
  using SlistAppend = curl_slist* (*)(curl_slist*, const char*);
  using SlistFreeAll = void (*)(curl_slist*);
  using VersionInfo = curl_version_info_data* (*)(CURLversion);

  GlobalInit global_init = nullptr;
  EasyInit easy_init = nullptr;
  EasyCleanup easy_cleanup = nullptr;
  EasyReset easy_reset = nullptr;
  EasySetopt easy_setopt = nullptr;
  EasyGetinfo easy_getinfo = nullptr;
  EasyPerform easy_perform = nullptr;
  EasyStrerror easy_strerror = nullptr;
  SlistAppend slist_append = nullptr;
  SlistFreeAll slist_free_all = nullptr;
  VersionInfo version_info = nullptr;
  std::string library;  // the file the symbols came from
  std::string version;  // "8.5.0"
};

// The process's libcurl, loaded and globally initialised once. Throws Error(ENOENT) naming every
// place it looked when there is none, Error(ENOSYS) when it lacks a function or is older than
// 7.75 (the first with AWS SigV4 signing).
const CurlApi& curl_api();

}  // namespace hbmio::shim
