#!/usr/bin/env bash
# Copies the binaries a GPU run needs into .gpu/ (stripped; git-ignored): the GPU machine has no
# liburing, so hbmio is built here, with liburing and the CUDA runtime linked statically.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build --preset default -j "$(nproc)"
rm -rf .gpu && mkdir -p .gpu
cp build/hbmio build/tests/hbmio_tests build/tests/cufile_tests build/libhbmio.a .gpu/
strip --strip-debug .gpu/hbmio .gpu/hbmio_tests .gpu/cufile_tests .gpu/libhbmio.a
du -sh .gpu
