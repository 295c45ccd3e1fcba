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
#            (bench/peers/ckpt_compare.py)
#   pybench  hbmio.load_file / save_file in Python against safetensors (bench/peers/py_compare.py)
#   multi    two GPUs (nvidia-h200-x2): --into cuda:0,1 both placements, and torchrun with NCCL
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

for stage in "$@"; do
case $stage in
tests)
  log machine
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc; uname -r; python3 --version; df -hT /var/tmp | tail -1
  log "engine GPU tests"
  "$BIN/hbmio_tests" --gtest_brief=1 --gtest_filter='Gpu*:*/Gpu*' 2>&1 | tail -6
  log "engine host tests here"
  "$BIN/hbmio_tests" --gtest_brief=1 --gtest_filter='-Gpu*:*/Gpu*:*LargeFile*' 2>&1 | tail -4
  log "checkpoint GPU tests"
  "$BIN/checkpoint_tests" --gtest_brief=1 2>&1 | tail -6
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
  log "build the Python package here"
  rm -rf /tmp/pysite
  # CMAKE_PREFIX_PATH set here replaces scikit-build-core's own, so nanobind is named directly.
  nanobind_dir=$(python3 -c 'import nanobind; print(nanobind.cmake_dir())') || { echo "no nanobind here"; continue; }
  python3 -m pip install -q --no-build-isolation --no-deps --no-index --target /tmp/pysite \
    -C cmake.define.CMAKE_PREFIX_PATH="$BIN/deps" -C cmake.define.nanobind_DIR="$nanobind_dir" \
    -C build-dir=/tmp/pybuild . >"$OUT/python-build.log" 2>&1 \
    || { echo "build failed:"; tail -30 "$OUT/python-build.log"; continue; }
  log "Python tests (GPU included)"
  install_wheels
  (cd /tmp && PYTHONPATH=/tmp/pysite:$PYTHONPATH python3 -m pytest -q -rs -p no:cacheprovider "$OLDPWD/python/tests" 2>&1 | tail -15)
  ;;
save)
  log "O_DIRECT write ceiling and uring write, 6 GiB from cuda:0"
  "$BIN/hbmio" bench --size 6GiB --dir /var/tmp --write --backends uring --runs 2 --json "$OUT/bench-write-6g.json" 2>&1 | tail -8
  log "ckpt save 6 GiB (48 x 128 MiB BF16) from cuda:0, durable, 3 runs"
  mkdir -p $W2
  for r in 1 2 3; do
    "$BIN/hbmio" ckpt save $W2/big.safetensors --count 48 --tensor-size 128MiB --from cuda:0 --json - | tee -a "$OUT/save.jsonl" |
      python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print(f\"save run $r: {s['seconds']:.3f} s, {s['gib_per_second']:.2f} GiB/s, CPU {s['cpu_seconds']:.2f} s\")"
  done
  "$BIN/hbmio" ckpt save $W2/small.safetensors --count 3072 --tensor-size 2MiB --from cuda:0 --json - | tee -a "$OUT/save.jsonl" |
    python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print(f\"save 3072 x 2 MiB: {s['seconds']:.3f} s, {s['gib_per_second']:.2f} GiB/s\")"
  ;;
load)
  install_wheels
  for f in big small; do
    peers=safetensors,fastsafetensors,runai
    [ $f = small ] && peers=safetensors
    log "load $f.safetensors into cuda:0: interleaved cold rounds, then warm"
    mode=both; [ $f = small ] && mode=warm
    python3 bench/peers/ckpt_compare.py $W2/$f.safetensors --hbmio "$BIN/hbmio" --rounds 3 --mode $mode --peers $peers \
      --json "$OUT/load-$f.jsonl" 2>&1 | grep -v '^\s*$' | cut -c1-400
  done
  ;;
pybench)
  install_wheels
  log "Python: hbmio.load_file vs safetensors.torch.load_file"
  PYTHONPATH=/tmp/pysite:$PYTHONPATH python3 bench/peers/py_compare.py $W2/big.safetensors --json "$OUT/py.jsonl" 2>&1 | cut -c1-400
  ;;
multi)
  # Two GPUs (nvidia-h200-x2): one checkpoint into both, each placement, C++ and torchrun.
  install_wheels
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  mkdir -p $W2
  [ -f $W2/big.safetensors ] || "$BIN/hbmio" ckpt save $W2/big.safetensors --count 48 --tensor-size 128MiB --from cuda:0 >/dev/null
  "$BIN/checkpoint_tests" --gtest_brief=1 --gtest_filter='GpuMultiLoad.*' 2>&1 | tail -3
  cat $W2/big.safetensors >/dev/null
  for p in shard replicate; do
    log "hbmio ckpt load --into cuda:0,1 --placement $p (warm)"
    "$BIN/hbmio" ckpt load $W2/big.safetensors --into cuda:0,1 --placement $p --verify --json "$OUT/multi-$p.json" | tail -3
  done
  log "torchrun, 2 ranks, NCCL"
  cat > /tmp/multi.py <<'PY'
import os, torch, torch.distributed as dist, hbmio, json, sys
dist.init_process_group("nccl"); r = dist.get_rank(); torch.cuda.set_device(r)
for placement in ("replicate", "shard"):
    rep = {}
    t = hbmio.load_file(sys.argv[1], device=f"cuda:{r}", group=dist.group.WORLD, placement=placement, report=rep)
    if r == 0: print(placement, json.dumps({k: v for k, v in rep.items() if k != "ranks"}))
dist.destroy_process_group()
PY
  PYTHONPATH=/tmp/pysite:$PYTHONPATH torchrun --nproc-per-node 2 /tmp/multi.py $W2/big.safetensors 2>&1 | tail -5
  ;;
*) echo "unknown stage $stage" ;;
esac
done
ls -la "$OUT"
