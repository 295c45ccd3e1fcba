#!/usr/bin/env bash
# The main job: install, build, and run `hbmio bench` on a generated sample file: every backend
# that works here, cold and warm, into GPU memory where there is a GPU and into pinned host
# memory where there is not, beside the storage and PCIe ceilings measured in the same run.
# Usage: scripts/quickstart.sh [SIZE]   (default 1GiB; the file goes to $HBMIO_SAMPLE_DIR or .)
# Writes hbmio-bench.json and hbmio-bench.svg in the repository's root (and says so at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
size="${1:-1GiB}"
bash scripts/install-deps.sh
# Only the hbmio command, in the tree of the `default` preset (build/): scripts/test.sh builds the
# rest of that tree later without compiling the library again. The tests and fuzz targets are not
# built here (a quarter of the build).
start=$SECONDS
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)" --target hbmio_cli
echo "built build/hbmio in $((SECONDS - start)) s"
hbmio=build/hbmio

"$hbmio" backends
echo
# hbmio bench makes a sample file of random data on the file system of --dir, measures every
# backend cold and warm beside this machine's ceilings, and removes the file. Without a GPU it
# reads into pinned host memory and says so.
"$hbmio" bench --size "$size" --dir "${HBMIO_SAMPLE_DIR:-.}" --json hbmio-bench.json --chart hbmio-bench.svg
echo
echo "Wrote $PWD/hbmio-bench.json (every figure and this machine's description) and $PWD/hbmio-bench.svg (the chart)."
echo "The hbmio command is $PWD/$hbmio; '$hbmio help' lists its commands."
