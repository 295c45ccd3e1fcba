#!/usr/bin/env bash
# The test command: installs what is missing, then builds and tests hbmio three ways
# (with CUDA, without CUDA, under ASan+UBSan) and builds the example against the installed
# package. GPU tests (ctest label "gpu") skip with the reason where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh

run() { echo "+ $*" >&2; "$@"; }
jobs=$(nproc)

for preset in default nocuda asan; do
  echo "=== $preset ==="
  run cmake --preset "$preset" >/dev/null
  run cmake --build --preset "$preset" -j "$jobs"
  run ctest --preset "$preset" -j 2
done

echo "=== example against the installed package ==="
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
run cmake --install build --prefix "$prefix/install" >/dev/null
run cmake -S examples/read_file -B "$prefix/example" -G Ninja -DCMAKE_PREFIX_PATH="$prefix/install" >/dev/null
run cmake --build "$prefix/example"
head -c 5000000 /dev/urandom > "$prefix/sample.bin"
run "$prefix/example/read_file" "$prefix/sample.bin"
echo "all test stages passed"
