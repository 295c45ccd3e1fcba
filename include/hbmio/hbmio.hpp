// Everything a user of hbmio needs: include this one header. (tests/public_headers.cmake checks it
// includes every public header, and that each compiles on its own.)
#pragma once
#include "hbmio/async_save.hpp"
#include "hbmio/cache.hpp"
#include "hbmio/checkpoint.hpp"
#include "hbmio/config.hpp"
#include "hbmio/doctor.hpp"
#include "hbmio/engine.hpp"
#include "hbmio/error.hpp"
#include "hbmio/file.hpp"
#include "hbmio/file_system.hpp"
#include "hbmio/memory.hpp"
#include "hbmio/options.hpp"
#include "hbmio/remote.hpp"
#include "hbmio/safetensors.hpp"
#include "hbmio/stream.hpp"
#include "hbmio/threads.hpp"
#include "hbmio/version.hpp"
