#!/usr/bin/env bash
# One lease on the GPU machine for lazy, per-tensor loads (bench/peers/lazy_compare.py):
# hbmio.open walks (file order, reverse, random) and get_slice against safetensors.safe_open,
# hbmio.load_file, InstantTensor (default and buffered backends) and fastsafetensors, on
# checkpoints written by safetensors.torch.save_file; from_pretrained stock vs
# hbmio.use_in_transformers(); fresh-process rows.
#
# Run from the repo root on the GPU machine, carrying:
#   .gpu/deps   headers and static libraries the Python extension builds against there (the machine
#               has no liburing); scripts/package-gpu-run.sh makes .gpu/
#   gpu-wheels  instanttensor and fastsafetensors (cp312 wheels); gpu-wheels/fallback holds
#               transformers and accelerate, installed only where the machine's own do not import
# Results go to $OUT: lazy.jsonl (one JSON line per measurement), lazy-tables.txt (the tables),
# lazy-progress.log (one line per load), python-build.log.
#
# Time: about 8 minutes on a fresh machine (the Python package build included). By default the
# small file is measured warm only: its cold rounds (~2.5 more minutes) are left out (COLD_FILES=big);
# COLD_FILES=big,small asks for them. lazy_compare.py starts nothing new once DEADLINE_S (470 s of
# this script) has passed, and says so in its tables; a round already started finishes.
#   usage: bench/lazy_gpu_run.sh [more lazy_compare.py arguments]
#   env:   ROUNDS (3), COLD_FILES (big), DEADLINE_S (470), LAZY_DIR (/var/tmp/lazy)
set -uo pipefail
T0=$SECONDS
BIN=$PWD/.gpu
OUT="${OUT:-/tmp/hbmio-out}"
mkdir -p "$OUT"
log() { echo; echo "=== $* ($(date -u +%H:%M:%S), +$((SECONDS - T0)) s) ==="; }

log machine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc; uname -r; python3 --version; df -hT /var/tmp | tail -1

log "wheels"
site=/tmp/lazysite
if [ ! -d $site/instanttensor ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site gpu-wheels/*.whl ||
    echo "wheel install failed: the peers will be skipped"
fi
if ! python3 -c "import transformers, accelerate" 2>/dev/null; then
  echo "transformers/accelerate missing here: installing gpu-wheels/fallback"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site gpu-wheels/fallback/*.whl
fi
export PYTHONPATH=/tmp/pysite:$site${PYTHONPATH:+:$PYTHONPATH}

# The Python package, built here once per machine from this working tree (as bench/gpu_ckpt_run.sh
# does): headers and static libraries from .gpu/deps, nanobind and scikit-build-core from the image.
if [ ! -f /tmp/pysite/hbmio/__init__.py ]; then
  log "build the Python package here"
  nanobind_dir=$(python3 -c 'import nanobind; print(nanobind.cmake_dir())') || echo "no nanobind here"
  python3 -m pip install -q --no-build-isolation --no-deps --no-index --target /tmp/pysite \
    -C cmake.define.CMAKE_PREFIX_PATH="$BIN/deps" -C cmake.define.nanobind_DIR="$nanobind_dir" \
    -C build-dir=/tmp/pybuild . >"$OUT/python-build.log" 2>&1 \
    || { echo "build failed (hbmio rows will be skipped):"; tail -30 "$OUT/python-build.log"; rm -rf /tmp/pysite; }
fi
python3 -c "import hbmio; print('hbmio', hbmio.__version__, 'from', hbmio.__file__)" 2>&1 | tail -1

log "lazy_compare.py: warm both files, cold ${COLD_FILES:-big}, from_pretrained, fresh processes"
budget=$(( ${DEADLINE_S:-470} - (SECONDS - T0) ))
[ $budget -lt 60 ] && budget=60
PYTHONUNBUFFERED=1 python3 bench/peers/lazy_compare.py --dir "${LAZY_DIR:-/var/tmp/lazy}" --device cuda:0 \
  --rounds "${ROUNDS:-3}" --cold-files "${COLD_FILES:-big}" --budget-s $budget --json "$OUT/lazy.jsonl" "$@" \
  2>"$OUT/lazy-progress.log" | tee "$OUT/lazy-tables.txt"
rc=${PIPESTATUS[0]}
if [ "$rc" != 0 ]; then echo "lazy_compare.py exited $rc; its last lines:"; tail -25 "$OUT/lazy-progress.log"; fi
grep -c '"ok": false' "$OUT/lazy.jsonl" | sed 's/^/results that failed their check: /'
log "done"
ls -la "$OUT"
