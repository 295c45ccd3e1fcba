// The one configuration. Every HBMIO_* environment variable hbmio reads is read in
// src/core/config.cpp and nowhere else: the option structs take their defaults from it
// (Options::from_env, RemoteOptions::from_env), and the command line and the Python package ask
// it (configured_backend, configured_readahead) instead of reading the environment themselves.
// docs/configuration.md shows the same table; tests/config_test.cpp keeps the two equal.
//
// An invalid value is an Error(EINVAL) naming the variable, the value and what it accepts, thrown
// when the value is first used (a variable that nothing asks for is not checked).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace hbmio {

struct ConfigVariable {
  std::string_view name;           // "HBMIO_CHUNK_SIZE"
  std::string_view default_value;  // as docs/configuration.md shows it: "16MiB", "auto"
  std::string_view accepted;       // the values it accepts: "1..4096", "on | off | auto"
  std::string_view meaning;        // what it sets (the option field, where there is one)
};

// Every HBMIO_* variable, in the order of docs/configuration.md.
std::span<const ConfigVariable> config_variables() noexcept;

// The backend of a call that names none (make_engine(""), an empty LoadOptions::backend,
// SaveOptions::backend or StreamOptions::backend, the command's --backend, Python's backend=None):
// HBMIO_BACKEND where set, else "auto". Throws Error(EINVAL) for a name that is no backend.
std::string configured_backend();

// How far ahead of a walk Python's hbmio.open reads tensors not yet asked for, in bytes
// (readahead=None): HBMIO_READAHEAD where set, else 1 GiB; 0 turns reading ahead off.
std::uint64_t configured_readahead();

// HBMIO_CACHE: the Unix socket of the resident cache (hbmio/cache.hpp) that loads ask first; ""
// where unset (no cache). HBMIO_CACHE_ADD=on: they also ask it to take in the files it lacks.
std::string configured_cache_socket();
bool configured_cache_add();

// The path set in `variable`, one of HBMIO_CUFILE_LIBRARY, HBMIO_CURL_LIBRARY and
// HBMIO_NCCL_LIBRARY (the copy of an optional library to load); "" where it is not set.
std::string configured_library(std::string_view variable);

}  // namespace hbmio
