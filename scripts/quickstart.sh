#!/usr/bin/env bash
# The main job: install, build, and read a generated file through every backend that works
# here, into GPU memory where there is a GPU and into pinned host memory where there is not.
# Usage: scripts/quickstart.sh [SIZE]   (default 1GiB; the file goes to $HBMIO_SAMPLE_DIR or .)
set -euo pipefail
cd "$(dirname "$0")/.."
size="${1:-1GiB}"
bash scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)"
hbmio=build/hbmio

dir=$(mktemp -d "${HBMIO_SAMPLE_DIR:-.}/hbmio-sample-XXXXXX")
trap 'rm -rf "$dir"' EXIT
"$hbmio" backends
if "$hbmio" backends --json - | python3 -c 'import json,sys; sys.exit(0 if json.load(sys.stdin)["cuda"]["devices"] > 0 else 1)'; then
  into=cuda:0
else
  into=pinned
  echo "No GPU here: measuring storage into pinned host memory."
fi
echo "Generating a $size sample file in $dir ..."
"$hbmio" write "$dir/sample.bin" --size "$size" --sync >/dev/null
for backend in posix uring cufile auto; do
  if "$hbmio" backends --json - | python3 -c "import json,sys; sys.exit(0 if any(b['name']=='$backend' and b['available'] for b in json.load(sys.stdin)['backends']) else 1)"; then
    "$hbmio" read "$dir/sample.bin" --into "$into" --backend "$backend" --verify | head -n 1
  else
    echo "$backend: not available here (see 'hbmio backends')"
  fi
done
