#!/usr/bin/env bash
# Tuning experiments on the GPU machine (one call): cold 6 GiB reads into cuda:0 under engine
# variants, and saves with and without checksums beside the O_DIRECT write ceiling. Leads for
# bench/RESULTS.md's tuning notes, not results. Needs .gpu/ (scripts/package-gpu-run.sh).
#   warm: warm loads of both W2 files into cuda:0 (INTO: other memory) (`hbmio ckpt load --runs 6`, median of the last 5)
#   under WARM_VARIANTS "label:K=V ...;..." (environment variables; HBMIO=PATH another executable,
#   e.g. one built with other constants), rounds interleaved.
#   hybrid: warm big.safetensors into cuda:0 by registration + DMA of a fraction of the file beside
#   pread copies of the rest (.gpu/page_cache_dma; HYBRID fractions, COPIERS thread counts).
#   usage: bench/tune_run.sh read|save|warm|hybrid ...   env: VARIANTS "label=flags;..." for read
set -uo pipefail
BIN=$PWD/.gpu
W2=/var/tmp/w2
mkdir -p $W2
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
for stage in "$@"; do
case $stage in
read)
  [ -f $W2/big.safetensors ] || "$BIN/hbmio" ckpt generate $W2/big.safetensors --force --count 48 --tensor-size 128MiB --from cuda:0 >/dev/null
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
      "$BIN/hbmio" ckpt generate $W2/big.safetensors --force --count 48 --tensor-size 128MiB --from cuda:0 $chk ${SAVE_FLAGS:-} --json - |
        python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print(f\"save round $round ${chk:-checksums}: {s['seconds']:.3f} s {s['gib_per_second']:.2f} GiB/s\")"
    done
    "$BIN/hbmio" bench --size 6GiB --dir /var/tmp --write --backends uring --runs 1 2>&1 | grep -A3 "^write" | tail -2
  done
  ;;
warm)
  [ -f $W2/big.safetensors ] || "$BIN/hbmio" ckpt generate $W2/big.safetensors --force --count 48 --tensor-size 128MiB --from cuda:0 >/dev/null
  [ -f $W2/small.safetensors ] || "$BIN/hbmio" ckpt generate $W2/small.safetensors --force --count 3072 --tensor-size 2MiB --from cuda:0 >/dev/null
  cat $W2/big.safetensors $W2/small.safetensors >/dev/null
  IFS=';' read -ra vs <<<"${WARM_VARIANTS:-default:}"
  for round in 1 2 3 4; do
    for f in big small; do
      for v in "${vs[@]}"; do
        label=${v%%:*}
        # shellcheck disable=SC2086
        env ${v#*:} bash -c '"${HBMIO:-$0}" ckpt load "$1" --into "${INTO:-cuda:0}" --runs 6 --json -' "$BIN/hbmio" $W2/$f.safetensors |
          python3 -c "import json,statistics,sys; j=json.load(sys.stdin); r=j['run_seconds'][1:]; m=statistics.median(r); print(json.dumps({'round': $round, 'file': '$f', 'variant': '$label', 'median_s': round(m,4), 'gib_per_s': round(j['stats']['bytes']/2**30/m,2), 'runs': [round(x,4) for x in j['run_seconds']], 'cpu_s': j['stats'].get('cpu_seconds')}))"
      done
    done
  done
  ;;
hybrid)
  [ -f $W2/big.safetensors ] || "$BIN/hbmio" ckpt generate $W2/big.safetensors --force --count 48 --tensor-size 128MiB --from cuda:0 >/dev/null
  cat $W2/big.safetensors >/dev/null
  HYBRID="${HYBRID:-0 0.3 0.4 0.5}" COPIERS="${COPIERS:-8 14}" "$BIN/page_cache_dma" $W2/big.safetensors
  ;;
esac
done
