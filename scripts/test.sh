#!/usr/bin/env bash
# The test command: installs what is missing, then builds and tests hbmio three ways
# (with CUDA, without CUDA, under ASan+UBSan) and its library tests under TSan, builds the example against the installed
# package, and builds and tests the Python package (python/). GPU tests (ctest label "gpu",
# pytest's cuda marks) skip with the reason where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
stage_start=$SECONDS
stage() {  # prints how long the stage before took, then names the next
  echo "--- $((SECONDS - stage_start)) s"
  stage_start=$SECONDS
  echo "=== $* ==="
}
echo "=== dependencies ==="
bash scripts/install-deps.sh
# The tests' Python (pytest, the reference safetensors, torch, S3 servers) in build-python/venv,
# made from the system's own python3; the C++ tests' python3 and CMake's Python are this one too.
venv=$(bash scripts/test-env.sh | tail -n 1)
# shellcheck disable=SC1091
source "$venv/bin/activate"
cufile_wheel=$(ls -d build-python/cufile-1.15/nvidia/*/ 2>/dev/null | head -n 1 || true)
[ -z "$cufile_wheel" ] || export HBMIO_CUFILE_WHEEL="$PWD/${cufile_wheel%/}"
# The whole run needs about 12 GB of disk (four build trees, a venv with torch); say what there is,
# so that a run that stops on ENOSPC is recognised as such.
df -h . | sed 's/^/disk: /'

run() { echo "+ $*" >&2; "$@"; }
jobs=$(nproc)

for preset in default nocuda asan tsan; do
  stage "$preset"
  run cmake --preset "$preset" >/dev/null
  run cmake --build --preset "$preset" -j "$jobs"
  run ctest --preset "$preset" -j 2
done

stage "example against the installed package"
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
run cmake --install build --prefix "$prefix/install" >/dev/null
run cmake -S examples/read_file -B "$prefix/example" -G Ninja -DCMAKE_PREFIX_PATH="$prefix/install" >/dev/null
run cmake --build "$prefix/example"
head -c 5000000 /dev/urandom > "$prefix/sample.bin"
run "$prefix/example/read_file" "$prefix/sample.bin"
stage "python package"
# pip builds the extension into build-python/ (incremental) with the venv's scikit-build-core and
# nanobind (no isolated build environment to download); tests run from outside the tree, on the
# installed package. An error, a failure or no tests collected (exit 5) all end the script.
CMAKE_BUILD_PARALLEL_LEVEL=2 run python -m pip install -q --no-cache-dir --disable-pip-version-check --no-build-isolation --no-deps .
(cd "$prefix" && run python -m pytest -q -rs -p no:cacheprovider "$OLDPWD/python/tests")
stage "done"
echo "all test stages passed"
