// Everything a user of hbmio needs: include this one header.
#pragma once
#include "hbmio/engine.hpp"
#include "hbmio/error.hpp"
#include "hbmio/file.hpp"
#include "hbmio/memory.hpp"
#include "hbmio/options.hpp"
#include "hbmio/remote.hpp"
#include "hbmio/version.hpp"
