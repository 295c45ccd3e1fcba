#!/usr/bin/env bash
# One lease on the GPU machine: GPU tests, the cuFile ABI check against the toolkit's cufile.h,
# `hbmio backends`, `hbmio bench` on a 4 GiB file (cold and warm, read and write) and the KvikIO
# peer on the same file. Binaries come prebuilt in $BIN (scripts/package-gpu-run.sh makes them
# here: the GPU machine has no liburing); results go to $OUT.
#   usage: bench/gpu_run.sh [BIN=.gpu] [SIZE=4GiB]
set -uo pipefail
BIN="${1:-.gpu}"
SIZE="${2:-4GiB}"
OUT="${OUT:-/tmp/hbmio-out}"
mkdir -p "$OUT"
export HBMIO_TEST_DIR=/var/tmp
log() { echo; echo "=== $* ==="; }

log machine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc; uname -r; df -hT /var/tmp | tail -1
date -u +%Y-%m-%dT%H:%M:%SZ

log "GPU tests (hbmio_tests, label gpu)"
"$BIN/hbmio_tests" --gtest_brief=1 --gtest_filter='Gpu*:*/Gpu*' 2>&1 | tail -15
log "cuFile GPU tests"
"$BIN/cufile_tests" --gtest_brief=1 --gtest_filter='CufileGpu.*' 2>&1 | tail -15
log "cuFile GPU tests with CUFILE_EXPERIMENTAL_FS=1"
CUFILE_EXPERIMENTAL_FS=1 "$BIN/cufile_tests" --gtest_brief=1 --gtest_filter='CufileGpu.*' 2>&1 | tail -15
log "all other tests on this machine"
"$BIN/hbmio_tests" --gtest_brief=1 --gtest_filter='-Gpu*:*/Gpu*:*LargeFile*' 2>&1 | tail -5

log "cuFile ABI against the toolkit's cufile.h"
if g++ -std=c++20 -I src -I include -I /usr/local/cuda/include tests/cufile_abi_test.cpp "$BIN/libhbmio.a" \
     -L/usr/local/cuda/lib64 -lcudart_static -ldl -lrt -lpthread -o /tmp/abi 2>"$OUT/abi.log"; then
  /tmp/abi && echo "ABI: identical"
else
  echo "ABI test did not compile:"; tail -20 "$OUT/abi.log"
fi

log backends
"$BIN/hbmio" backends
CUFILE_EXPERIMENTAL_FS=1 "$BIN/hbmio" backends

file=/var/tmp/hbmio-shard.bin
log "write a $SIZE sample shard"
"$BIN/hbmio" write-random "$file" --size "$SIZE" --sync --force

log "hbmio bench (read, cold and warm)"
CUFILE_EXPERIMENTAL_FS=1 "$BIN/hbmio" bench --file "$file" --backends posix,uring,cufile,auto --both --runs 5 \
  --json "$OUT/bench-read.json" --chart "$OUT/bench-read.svg" 2>&1
log "hbmio bench (write)"
CUFILE_EXPERIMENTAL_FS=1 "$BIN/hbmio" bench --size "$SIZE" --dir /var/tmp --write --backends posix,uring,cufile,auto --runs 5 \
  --json "$OUT/bench-write.json" --chart "$OUT/bench-write.svg" 2>&1

log "KvikIO peer on the same file"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
  for mode in --cold ""; do
    python3 bench/peers/kvikio_read.py "$file" --runs 5 --threads "$(nproc)" $mode | tee -a "$OUT/kvikio.jsonl"
  done
fi
rm -f "$file"
