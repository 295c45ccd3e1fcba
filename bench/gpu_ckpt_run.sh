#!/usr/bin/env bash
# One lease on the GPU machine for the checkpoint work: pick the stages to run.
#   tests    GPU tests of the engine (incl. batches) and of checkpoints (reference fixtures)
#   doctor   capture of this machine's sysfs (fixture), `hbmio doctor` live, and its cuFile
#            verdict against the cufile backend (tests/doctor_live_test.sh), without and with
#            CUFILE_EXPERIMENTAL_FS=1
#   python   builds the Python package here (headers and static libraries from .gpu/deps) and
#            runs its tests, GPU ones included
#   save     6 GiB (48 x 128 MiB BF16) saved from GPU memory, durable, beside the O_DIRECT write
#            ceiling (`hbmio bench --write`); also writes the W2 files the load stage reads
#   load     W2 loads into cuda:0, interleaved with the O_DIRECT ceiling and the peers
#            (bench/peers/ckpt_compare.py; load-big / load-small: one file; env ROUNDS (3),
#            WARM_RUNS (5), MODE cold|warm|both, VARIANTS: "label=flags;..." engine tunings as
#            further contenders; writes the W2 files first where they are missing)
#   savecmp  durable saves of 6 GiB from cuda:0 against the O_DIRECT write ceiling, rounds
#            interleaved and rotated (bench/peers/save_compare.py; ROUNDS, default 3; SAVE_ONLY:
#            contenders to run; SAVE_VARIANTS "label:K=V ...;...": further ckpt generate contenders
#            under those environment variables, HBMIO=PATH naming another executable)
#   firstuse the first warm load of a process against its next ones, per backend (what a program
#            that loads once pays; the first run's note itemises the set-up)
#   pytests  the Python test files named in $PYTESTS only
#   asave    background saves and DCP async_save: stall and time to durable (bench/peers/async_save_compare.py;
#            SAVES (20), ROUNDS (3), ASAVE_ONLY: contenders; ASAVE_ONLY=mix: blocking and background
#            saves interleaved in one process, the fair time-to-durable ratio on a drifting disk)
#   stream   hbmio.stream against DataLoader into cuda:0, cold and warm, alone and under a matmul
#            loop (bench/peers/stream_compare.py; STREAM_GIB (16), ROUNDS (2), STREAM_MODE)
#   pybench  hbmio.load_file / save_file in Python against safetensors (bench/peers/py_compare.py)
#   remote   checkpoints from a local SeaweedFS into cuda:0 and saves to it, against curl, boto3 and
#            Run:ai's S3 path (bench/peers/remote_compare.py; REMOTE_GIB (6), ROUNDS (2), REMOTE_NO_SAVES=1: loads only, REMOTE_ONLY: contenders; needs
#            .gpu/weed.xz and boto3/Run:ai wheels in .whl, see scripts/package-gpu-run.sh --remote)
#   smallshards  from_pretrained of a many-shard small model (15+ shards, 11 MiB) stock and through
#            hbmio.use_in_transformers(), first call and later calls, fresh processes (bench/peers/small_shards.py)
#   firstcall  the first from_pretrained call of a process profiled (cProfile), stock and through hbmio,
#            on the smallshards stage's model (bench/micro/first_call_probe.py)
#   prefetch safetensors 0.9's loaders (load_file mmap/pread, prefetch() and prefetch(plan)) against
#            hbmio's on files written by the reference (bench/peers/prefetch_compare.py; needs the
#            0.9 wheel in .gpu/st09, see scripts/package-gpu-run.sh; ROUNDS (3), PF_FILES "big small")
#   cache    the resident cache: its tests (GPU included, tests/cache_test.cpp) and W5, loads from
#            it against warm page-cache loads, safetensors 0.9's prefetch() and the pinned
#            host-to-device ceiling (bench/peers/cache_compare.py; ROUNDS (3), CACHE_FILES "big small":
#            hbmio-written 6 GiB files, made here where missing; CACHE_GPU_MEMORY=16GiB adds a
#            server with a device tier: device-to-device and shared (share=True) loads)
#   multi    two GPUs (nvidia-h200-x2): 12 GiB sharded, --into cuda:0,1 both placements, and
#            torchrun with NCCL beside fastsafetensors (bench/peers/multi_compare.py; TORCHRUN=0
#            skips it)
# Binaries and fixtures come prebuilt in .gpu/ (scripts/package-gpu-run.sh); results go to $OUT.
#   usage: bench/gpu_ckpt_run.sh STAGE...
set -uo pipefail
BIN=$PWD/.gpu
OUT="${OUT:-/tmp/hbmio-out}"
mkdir -p "$OUT"
export HBMIO_TEST_DIR=/var/tmp HBMIO_FIXTURES=$BIN/fixtures
W2=/var/tmp/w2
log() { echo; echo "=== $* ($(date -u +%H:%M:%S)) ==="; }
site=/tmp/site
install_wheels() {
  if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d $site/fastsafetensors ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site .whl/*.whl
  fi
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
}

# The Python package, built here once per machine (headers and static libraries from .gpu/deps).
build_python() {
  [ -f /tmp/pysite/hbmio/__init__.py ] && return 0
  log "build the Python package here"
  # CMAKE_PREFIX_PATH set here replaces scikit-build-core's own, so nanobind is named directly.
  local nanobind_dir
  nanobind_dir=$(python3 -c 'import nanobind; print(nanobind.cmake_dir())') || { echo "no nanobind here"; return 1; }
  python3 -m pip install -q --no-build-isolation --no-deps --no-index --target /tmp/pysite \
    -C cmake.define.CMAKE_PREFIX_PATH="$BIN/deps" -C cmake.define.nanobind_DIR="$nanobind_dir" \
    -C build-dir=/tmp/pybuild . >"$OUT/python-build.log" 2>&1 \
    || { echo "build failed:"; tail -30 "$OUT/python-build.log"; rm -rf /tmp/pysite; return 1; }
}

# The hbmio command: the Python build's, else the carried one.
built_cli() { ls /tmp/pysite/bin/hbmio /tmp/pybuild/hbmio/hbmio "$BIN/hbmio" 2>/dev/null | head -1; }

for stage in "$@"; do
case $stage in
tests)
  # The NCCL test (GpuNcclLoad) uses PyTorch's libnccl; NVLink multicast stays off.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  nccl_lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
  [ -n "$nccl_lib" ] && export HBMIO_NCCL_LIBRARY=$nccl_lib
  export HBMIO_NCCL_RANK_BIN=$BIN/nccl_rank
  log machine
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc; uname -r; python3 --version; df -hT /var/tmp | tail -1
  # Each binary's whole output also goes to $OUT (a call returns only the tail of the output).
  log "engine GPU tests"
  "$BIN/hbmio_tests" --gtest_brief=1 --gtest_filter='Gpu*:*/Gpu*' > "$OUT/tests-engine-gpu.log" 2>&1; tail -6 "$OUT/tests-engine-gpu.log"
  log "engine host tests here"
  "$BIN/hbmio_tests" --gtest_brief=1 --gtest_filter='-Gpu*:*/Gpu*:*LargeFile*' > "$OUT/tests-engine-host.log" 2>&1; tail -4 "$OUT/tests-engine-host.log"
  log "checkpoint GPU tests"
  "$BIN/checkpoint_tests" --gtest_brief=1 > "$OUT/tests-checkpoint.log" 2>&1; tail -6 "$OUT/tests-checkpoint.log"
  ;;
cache)
  log "resident cache tests (GPU included)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  HBMIO_CLI="$BIN/hbmio" "$BIN/cache_tests" --gtest_brief=1 > "$OUT/tests-cache.log" 2>&1; tail -6 "$OUT/tests-cache.log"
  build_python || continue
  [ -d /tmp/st09/safetensors ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/st09 "$BIN"/st09/*.whl
  mkdir -p /var/tmp/cache
  files=()
  for f in ${CACHE_FILES:-big small}; do
    p=/var/tmp/cache/$f.safetensors
    if [ ! -f $p ]; then
      if [ $f = big ]; then "$BIN/hbmio" ckpt generate $p --count 48 --tensor-size 128MiB --from cuda:0 > /dev/null
      else "$BIN/hbmio" ckpt generate $p --count 3072 --tensor-size 2MiB --from cuda:0 > /dev/null; fi
    fi
    files+=($p)
  done
  log "W5: loads from the resident cache into cuda:0"
  PYTHONPATH=/tmp/pysite${PYTHONPATH:+:$PYTHONPATH} python3 bench/peers/cache_compare.py "${files[@]}" --hbmio "$BIN/hbmio" \
    --st09 /tmp/st09 --rounds "${ROUNDS:-3}" ${CACHE_GPU_MEMORY:+--gpu-memory "$CACHE_GPU_MEMORY"} --json "$OUT/cache.jsonl" 2>&1 | tee "$OUT/cache.txt" || echo "W5 FAILED (see above)"
  ;;
doctor)
  log "capture sysfs"
  bash scripts/capture-sysfs.sh "$OUT/gpu-h200.tar.xz" 2>&1 | tail -3
  log "hbmio doctor /tmp /var/tmp"
  "$BIN/hbmio" doctor /tmp /var/tmp 2>&1 | tee "$OUT/doctor.txt"
  "$BIN/hbmio" doctor /tmp /var/tmp --json "$OUT/doctor.json" >/dev/null
  log "doctor verdict vs cufile backend"
  bash tests/doctor_live_test.sh "$BIN/hbmio"
  CUFILE_EXPERIMENTAL_FS=1 bash tests/doctor_live_test.sh "$BIN/hbmio"
  ;;
python)
  build_python || continue
  log "Python tests (GPU included)"
  install_wheels
  (cd /tmp && PYTHONPATH=/tmp/pysite${PYTHONPATH:+:$PYTHONPATH} python3 -m pytest -q -rfEs -p no:cacheprovider "$OLDPWD/python/tests" > /tmp/pytest.out 2>&1; tail -40 /tmp/pytest.out; cp /tmp/pytest.out "$OUT/pytest.out")
  ;;
save)
  log "O_DIRECT write ceiling and uring write, 6 GiB from cuda:0"
  "$BIN/hbmio" bench --size 6GiB --dir /var/tmp --write --backends uring --runs 2 --json "$OUT/bench-write-6g.json" 2>&1 | tail -8
  log "ckpt generate 6 GiB (48 x 128 MiB BF16) from cuda:0, durable, 3 runs"
  mkdir -p $W2
  for r in 1 2 3; do
    "$BIN/hbmio" ckpt generate $W2/big.safetensors --force --count 48 --tensor-size 128MiB --from cuda:0 --json - | tee -a "$OUT/save.jsonl" |
      python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print(f\"save run $r: {s['seconds']:.3f} s, {s['gib_per_second']:.2f} GiB/s, CPU {s['cpu_seconds']:.2f} s; {s['note']}\")"
  done
  "$BIN/hbmio" ckpt generate $W2/small.safetensors --force --count 3072 --tensor-size 2MiB --from cuda:0 --json - | tee -a "$OUT/save.jsonl" |
    python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print(f\"save 3072 x 2 MiB: {s['seconds']:.3f} s, {s['gib_per_second']:.2f} GiB/s; {s['note']}\")"
  ;;
load|load-big|load-small)
  # load: both files; every peer (hbmio's Python package among them), cold and warm, with the
  # engine variants of $VARIANTS (label=flags;...) as further contenders.
  install_wheels; build_python
  files="big small"; [ $stage = load-big ] && files=big; [ $stage = load-small ] && files=small
  vargs=(); IFS=';' read -ra vs <<<"${VARIANTS:-}"; for v in "${vs[@]}"; do [ -n "$v" ] && vargs+=(--variant "$v"); done
  mkdir -p $W2
  [ -f $W2/big.safetensors ] || "$BIN/hbmio" ckpt generate $W2/big.safetensors --force --count 48 --tensor-size 128MiB --from cuda:0 >/dev/null
  [ -f $W2/small.safetensors ] || "$BIN/hbmio" ckpt generate $W2/small.safetensors --force --count 3072 --tensor-size 2MiB --from cuda:0 >/dev/null
  for f in $files; do
    log "load $f.safetensors into cuda:0: interleaved cold rounds, then warm (${MODE:-both})"
    PYTHONPATH=/tmp/pysite${PYTHONPATH:+:$PYTHONPATH} python3 bench/peers/ckpt_compare.py $W2/$f.safetensors --hbmio "$BIN/hbmio" \
      --rounds "${ROUNDS:-3}" --warm-runs "${WARM_RUNS:-5}" --mode "${MODE:-both}" --peers safetensors,fastsafetensors,runai,hbmio.load_file "${vargs[@]}" \
      --json "$OUT/load-$f.jsonl" 2>&1 | grep -v '^\s*$' | cut -c1-300
  done
  ;;
savecmp)
  install_wheels; build_python
  log "saves from cuda:0 against the write ceiling, interleaved rounds"
  variants=()
  IFS=';' read -ra vs <<<"${SAVE_VARIANTS:-}"
  for v in "${vs[@]}"; do variants+=(--variant "$v"); done
  PYTHONPATH=/tmp/pysite${PYTHONPATH:+:$PYTHONPATH} python3 bench/peers/save_compare.py --hbmio "$BIN/hbmio" --dir /var/tmp \
    --rounds "${ROUNDS:-3}" ${SAVE_ONLY:+--only "$SAVE_ONLY"} "${variants[@]}" --json "$OUT/save-compare.jsonl" 2>&1 |
    grep -v '"round"' | cut -c1-300
  ;;
firstuse)
  log "first warm load of a process vs the next, small.safetensors into cuda:0"
  mkdir -p $W2
  [ -f $W2/small.safetensors ] || "$BIN/hbmio" ckpt generate $W2/small.safetensors --force --count 3072 --tensor-size 2MiB --from cuda:0 >/dev/null
  cat $W2/small.safetensors >/dev/null
  for backend in uring auto uring auto; do
    "$BIN/hbmio" ckpt load $W2/small.safetensors --into cuda:0 --backend $backend --runs 3 --json - | python3 -c "import json,sys; j=json.load(sys.stdin); j.pop('tensors',None); print(json.dumps(j))" | tee -a "$OUT/firstuse.jsonl" |
      python3 -c "import json,sys; j=json.load(sys.stdin); print('$backend', [round(x,3) for x in j['run_seconds']], '|', j['run_notes'][0][-220:])"
  done
  ;;
pytests)
  # Named Python test files only ($PYTESTS, e.g. "test_async_save.py test_dcp.py"), GPU included.
  build_python || continue
  log "Python tests: ${PYTESTS:-}"
  export HBMIO_CLI=$(built_cli)  # the command-line tests' hbmio (pip --target installs no script on PATH)
  [ -x /tmp/weedbin/weed ] && export PATH=/tmp/weedbin:$PATH
  (cd /tmp && PYTHONPATH=/tmp/pysite${PYTHONPATH:+:$PYTHONPATH} python3 -m pytest -q -rfEs -p no:cacheprovider \
     $(for t in ${PYTESTS:-}; do echo "$OLDPWD/python/tests/$t"; done) > /tmp/pytest.out 2>&1; tail -40 /tmp/pytest.out; cp /tmp/pytest.out "$OUT/pytest.out")
  ;;
asave)
  # Background saves: stall and time to durable of a 6 GiB state on cuda:0 changed between saves,
  # beside one device-to-pinned copy, a blocking save and dcp.async_save (bench/peers/async_save_compare.py).
  build_python || continue
  log "background saves: 6 GiB on cuda:0"
  PYTHONPATH=/tmp/pysite${PYTHONPATH:+:$PYTHONPATH} python3 bench/peers/async_save_compare.py --saves "${SAVES:-20}" --rounds "${ROUNDS:-3}" \
    ${ASAVE_ONLY:+--only "$ASAVE_ONLY"} --json "$OUT/asave.jsonl" 2>&1 | tee "$OUT/asave.txt" | grep -v '^{'
  ;;
stream)
  # Training-batch ingestion: .npy shards (STREAM_GIB, default 16) into cuda:0 in 64 MiB batches,
  # hbmio.stream against DataLoader (8 workers, pinned), beside the storage and page-cache
  # ceilings, alone and under a matmul loop (bench/peers/stream_compare.py). STREAM_MODE (cold,
  # warm, both), STREAM_ONLY, STREAM_LOADS and STREAM_READ_AHEAD pass on as its options;
  # STREAM_TAG names the output files (stream-TAG.jsonl) of one variant among several.
  build_python || continue
  log "batch ingestion: ${STREAM_GIB:-16} GiB of .npy shards into cuda:0"
  PYTHONPATH=/tmp/pysite${PYTHONPATH:+:$PYTHONPATH} python3 bench/peers/stream_compare.py --dir /var/tmp/stream --gib "${STREAM_GIB:-16}" \
    --rounds "${ROUNDS:-2}" ${STREAM_MODE:+--mode "$STREAM_MODE"} ${STREAM_ONLY:+--only "$STREAM_ONLY"} \
    ${STREAM_LOADS:+--loads "$STREAM_LOADS"} ${STREAM_READ_AHEAD:+--read-ahead "$STREAM_READ_AHEAD"} \
    --json "$OUT/stream${STREAM_TAG:+-$STREAM_TAG}.jsonl" 2>&1 | tee "$OUT/stream${STREAM_TAG:+-$STREAM_TAG}.txt" | cut -c1-400
  ;;
pybench)
  install_wheels; build_python
  log "Python: hbmio.load_file vs safetensors.torch.load_file"
  for f in ${PYFILES:-big small}; do
    log "Python: $f.safetensors"
    PYTHONPATH=/tmp/pysite${PYTHONPATH:+:$PYTHONPATH} python3 bench/peers/py_compare.py $W2/$f.safetensors --rounds "${ROUNDS:-3}" --json "$OUT/py-$f.jsonl" 2>&1 | cut -c1-400
  done
  ;;
smallshards)
  build_python || continue
  log "from_pretrained of a small many-shard model into cuda:0, stock and through hbmio"
  PYTHONPATH=/tmp/pysite${PYTHONPATH:+:$PYTHONPATH} python3 bench/peers/small_shards.py --device cuda:0 --dir /var/tmp/small-shards \
    --runs "${ROUNDS:-5}" --json "$OUT/small-shards.jsonl" 2>&1 | tail -8
  ;;
firstcall)
  # Where the first from_pretrained call of a process goes, stock and through hbmio (cProfile),
  # on the smallshards stage's model (run that stage first).
  build_python || continue
  log "first from_pretrained call profiled, stock and through hbmio"
  PYTHONPATH=/tmp/pysite${PYTHONPATH:+:$PYTHONPATH} python3 bench/micro/first_call_probe.py "$(dirname "$(ls -d /var/tmp/small-shards/*/config.json | head -1)")" cuda:0 \
    >"$OUT/first_call.txt" 2>&1
  grep -E "^=====|first .* second|import hbmio" "$OUT/first_call.txt"
  ;;
prefetch)
  build_python || continue
  [ -d /tmp/st09/safetensors ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/st09 "$BIN"/st09/*.whl
  P=/var/tmp/pf; mkdir -p $P
  for f in ${PF_FILES:-big small}; do
    if [ ! -f $P/$f.safetensors ]; then  # written by the reference (0.8), random bf16 bits
      python3 -c "
import torch, safetensors.torch as st
n, rows = (48, 8192) if '$f' == 'big' else (3072, 1024)
g = torch.Generator().manual_seed(7)
st.save_file({f't{i:04d}': torch.randint(-32768, 32767, (rows, rows), dtype=torch.int16, generator=g).view(torch.bfloat16) for i in range(n)}, '$P/$f.safetensors')"
    fi
    log "prefetch and loaders into cuda:0, $f.safetensors, warm"
    PYTHONPATH=/tmp/pysite${PYTHONPATH:+:$PYTHONPATH} python3 bench/peers/prefetch_compare.py $P/$f.safetensors --st09 /tmp/st09 \
      --rounds "${ROUNDS:-3}" --json "$OUT/prefetch.jsonl" 2>&1 | grep -v "^round" | tail -14
  done
  ;;
multi)
  # Two GPUs (nvidia-h200-x2): a 12 GiB sharded checkpoint into both, each placement; C++
  # (--into cuda:0,1) and torchrun with NCCL beside fastsafetensors' own distribution
  # (bench/peers/multi_compare.py), from the page cache.
  install_wheels; build_python
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  M=/var/tmp/m12
  [ -f $M/model.safetensors.index.json ] || "$BIN/hbmio" ckpt generate $M --force --max-shard-size 3GiB --count 96 --tensor-size 128MiB --from cuda:0 | tail -1
  log "checkpoint GPU tests across devices"
  "$BIN/checkpoint_tests" --gtest_brief=1 --gtest_filter='GpuMultiLoad.*:MultiLoad.*' 2>&1 | tail -3
  cat $M/*.safetensors >/dev/null
  log "hbmio ckpt load 12 GiB --into cuda:0 (one GPU), warm, 5 runs"
  "$BIN/hbmio" ckpt load $M --into cuda:0 --runs 5 --json "$OUT/multi-single.json" >/dev/null
  python3 -c "import json; j=json.load(open('$OUT/multi-single.json')); print('cuda:0 median', round(j['median_seconds'],3), 's', round(j['median_gib_per_second'],2), 'GiB/s', j['stats']['note'][:200])"
  for p in shard replicate; do
    log "hbmio ckpt load 12 GiB --into cuda:0,1 --placement $p, warm, 5 runs (and once with --verify)"
    "$BIN/hbmio" ckpt load $M --into cuda:0,1 --placement $p --runs 5 --json "$OUT/multi-$p.json" >/dev/null
    python3 -c "import json; j=json.load(open('$OUT/multi-$p.json')); print('$p median', round(j['median_seconds'],3), 's', round(j['median_gib_per_second_delivered'],2), 'GiB/s delivered, runs', [round(x,3) for x in j['run_seconds']])"
    "$BIN/hbmio" ckpt load $M --into cuda:0,1 --placement $p --verify | tail -3
  done
  [ "${TORCHRUN:-1}" = 1 ] || continue
  log "torchrun, 2 ranks, NCCL: hbmio.load_file(group=...) vs fastsafetensors"
  PYTHONPATH=/tmp/pysite${PYTHONPATH:+:$PYTHONPATH} torchrun --nproc-per-node 2 bench/peers/multi_compare.py $M --runs 5 \
    --json "$OUT/multi-torchrun.jsonl" 2>&1 | grep -v '^W\|^\s*$' | cut -c1-400 | tail -20
  ;;
remote)
  # Checkpoints from a local S3 server (SeaweedFS, `weed` from .gpu/weed.xz) into cuda:0: hbmio
  # against parallel curl, boto3 and Run:ai Model Streamer's S3 path, then saves against boto3
  # (bench/peers/remote_compare.py; REMOTE_GIB (6), ROUNDS (2)); boto3 and Run:ai as .whl wheels.
  install_wheels; build_python || continue
  [ -x /tmp/weedbin/weed ] || { mkdir -p /tmp/weedbin && xz -dc "$BIN/weed.xz" > /tmp/weedbin/weed && chmod +x /tmp/weedbin/weed; }
  log "remote: ${REMOTE_GIB:-6} GiB from SeaweedFS on 127.0.0.1 into cuda:0"
  PATH=/tmp/weedbin:/tmp/pysite/bin:$PATH PYTHONPATH=/tmp/pysite${PYTHONPATH:+:$PYTHONPATH} python3 -u bench/peers/remote_compare.py \
    --gib "${REMOTE_GIB:-6}" --rounds "${ROUNDS:-2}" --device cuda:0 ${REMOTE_PARTS:+--hbmio-parts "$REMOTE_PARTS"} --hbmio-bench "$(built_cli)" \
    ${REMOTE_NO_SAVES:+--no-saves} ${REMOTE_ONLY:+--only "$REMOTE_ONLY"} \
    --json "$OUT/remote.jsonl" 2>&1 | tee "$OUT/remote.txt" | cut -c1-300
  ;;
*) echo "unknown stage $stage" ;;
esac
done
ls -la "$OUT"
