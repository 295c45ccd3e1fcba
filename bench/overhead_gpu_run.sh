#!/usr/bin/env bash
# One lease on the GPU machine for the execution-context change: the GPU tests of this build, then
# this build beside an older one (.gpu/before: request_overhead_before and hbmio_before, built from
# the previous commit by hand) in interleaved rounds:
#   - per-request overhead: 20,000 warm 64 KiB reads through one engine into pinned memory and
#     into cuda:0 (bench/micro/request_overhead.cpp), one at a time and in batches of 16;
#   - 6 GiB loads into cuda:0 (48 x 128 MiB and 3,072 x 2 MiB), warm and cold;
#   - durable saves of 3,072 x 2 MiB from cuda:0.
# Run from the repo root there, carrying .gpu (scripts/package-gpu-run.sh). Results go to $OUT:
# overhead.jsonl, load.jsonl, save.jsonl, tests.log. About 8 minutes.
set -uo pipefail
T0=$SECONDS
BIN=$PWD/.gpu
OUT="${OUT:-/tmp/hbmio-out}"
W=/var/tmp/overhead
mkdir -p "$OUT" $W
log() { echo; echo "=== $* ($(date -u +%H:%M:%S), +$((SECONDS - T0)) s) ==="; }

log machine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc; uname -r; df -hT /var/tmp | tail -1

log "the C++ tests of this build (GPU suites included)"
export HBMIO_TEST_DIR=$W HBMIO_FIXTURES=$BIN/fixtures HBMIO_NCCL_RANK_BIN=$BIN/nccl_rank
for t in hbmio_tests checkpoint_tests cufile_tests; do
  echo "--- $t" >>"$OUT/tests.log"
  "$BIN/$t" --gtest_brief=1 --gtest_filter="${TEST_FILTER:--*LargeFile*}" >>"$OUT/tests.log" 2>&1
  echo "$t: exit $?, $(grep -cE '^\[  FAILED  \] [A-Za-z]' "$OUT/tests.log") failed so far"
done
grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests.log"

log "per-request overhead, interleaved"
head -c 1G /dev/urandom >$W/warm.bin && cat $W/warm.bin >/dev/null
for round in 1 2; do
  for build in before after; do
    exe=$BIN/request_overhead; [ $build = before ] && exe=$BIN/before/request_overhead_before
    for mem in pinned cuda:0; do
      "$exe" $W/warm.bin 20000 64K $mem uring,posix,auto | sed "s/^{/{\"build\": \"$build\", \"round\": $round, /" | tee -a "$OUT/overhead.jsonl"
    done
  done
done

log "6 GiB loads into cuda:0, interleaved"
"$BIN/hbmio" ckpt generate $W/big.safetensors --force --count 48 --tensor-size 128MiB --from cuda:0 >/dev/null
"$BIN/hbmio" ckpt generate $W/small.safetensors --force --count 3072 --tensor-size 2MiB --from cuda:0 >/dev/null
for round in 1 2; do
  for f in big small; do
    for build in before after; do
      exe=$BIN/hbmio; [ $build = before ] && exe=$BIN/before/hbmio_before
      for mode in warm cold; do
        flag=--drop-cache
        # Warm: the whole file in the page cache first (a cold round before leaves it out).
        [ $mode = warm ] && flag="" && cat $W/$f.safetensors >/dev/null
        "$exe" ckpt load $W/$f.safetensors --into cuda:0 --runs 3 $flag --json - 2>/dev/null |
          python3 -c "import json,sys; j=json.load(sys.stdin); j.pop('tensors',None); print(json.dumps(dict(build='$build', round=$round, file='$f', mode='$mode', **j)))" |
          tee -a "$OUT/load.jsonl" | cut -c1-240
      done
    done
  done
done

log "saves of 3,072 x 2 MiB from cuda:0, interleaved"
for round in 1 2 3; do
  for build in before after; do
    exe=$BIN/hbmio; [ $build = before ] && exe=$BIN/before/hbmio_before
    "$exe" ckpt generate $W/save.safetensors --force --count 3072 --tensor-size 2MiB --from cuda:0 --json - 2>/dev/null |
      python3 -c "import json,sys; j=json.load(sys.stdin); j.pop('tensors',None); print(json.dumps(dict(build='$build', round=$round, **j)))" |
      tee -a "$OUT/save.jsonl" | cut -c1-240
  done
done
rm -rf $W
log done
