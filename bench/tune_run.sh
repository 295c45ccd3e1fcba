#!/usr/bin/env bash
# Tuning experiments on the GPU machine (one call): cold 6 GiB reads into cuda:0 under engine
# variants, and saves with and without checksums beside the O_DIRECT write ceiling. Leads for
# bench/RESULTS.md's tuning notes, not results. Needs .gpu/ (scripts/package-gpu-run.sh).
#   usage: bench/tune_run.sh read|save ...   env: VARIANTS "label=flags;..." for read
set -uo pipefail
BIN=$PWD/.gpu
W2=/var/tmp/w2
mkdir -p $W2
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
for stage in "$@"; do
case $stage in
read)
  [ -f $W2/big.safetensors ] || "$BIN/hbmio" ckpt save $W2/big.safetensors --count 48 --tensor-size 128MiB --from cuda:0 >/dev/null
  IFS=';' read -ra vs <<<"${VARIANTS:-default=--direct-io on}"
  for round in 1 2; do
    for v in "${vs[@]}"; do
      label=${v%%=*}; flags=${v#*=}
      drop
      # shellcheck disable=SC2086
      "$BIN/hbmio" read $W2/big.safetensors --into cuda:0 $flags --json - 2>/dev/null |
        python3 -c "import json,sys; s=json.load(sys.stdin); s=s.get('stats',s); print(f\"read round $round {'$label':>12}: {s['seconds']:.3f} s {s['gib_per_second']:.2f} GiB/s\")"
    done
  done
  ;;
save)
  for round in 1 2; do
    for chk in "" "--no-checksums"; do
      "$BIN/hbmio" ckpt save $W2/big.safetensors --count 48 --tensor-size 128MiB --from cuda:0 $chk ${SAVE_FLAGS:-} --json - |
        python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print(f\"save round $round ${chk:-checksums}: {s['seconds']:.3f} s {s['gib_per_second']:.2f} GiB/s\")"
    done
    "$BIN/hbmio" bench --size 6GiB --dir /var/tmp --write --backends uring --runs 1 2>&1 | grep -A3 "^write" | tail -2
  done
  ;;
esac
done
