#!/usr/bin/env bash
# The test command: installs what is missing, then builds and tests hbmio three ways (with CUDA;
# without CUDA under ASan+UBSan, which is also the build without CUDA; the library's tests under
# TSan), builds the example against the installed package, and builds and tests the Python package
# (python/). GPU tests (ctest label "gpu", pytest's cuda marks) skip with the reason where there is
# no GPU. Prints each stage's duration as it ends and all of them at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
stage_start=$SECONDS
stage_name=dependencies
durations=()
stage() {  # ends the stage running (prints how long it took), then names the next
  durations+=("$(printf '%6d s  %s' $((SECONDS - stage_start)) "$stage_name")")
  echo "--- $stage_name: $((SECONDS - stage_start)) s"
  stage_start=$SECONDS
  stage_name="$*"
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
# The whole run needs about 12 GB of disk (four build trees with python's, a venv with torch); say what there is,
# so that a run that stops on ENOSPC is recognised as such.
df -h . | sed 's/^/disk: /'

run() { echo "+ $*" >&2; "$@"; }
jobs=$(nproc)

# The ASan+UBSan build is also the build without CUDA: on a machine without a GPU the CUDA build's
# own code runs only its no-device paths, which the default build's tests cover. TSan checks the
# library's threads: only the test programs its preset's filter runs are built.
declare -A targets=([tsan]="hbmio_tests checkpoint_tests format_tests")
for preset in default asan tsan; do
  stage "$preset"
  run cmake --preset "$preset" >/dev/null
  # shellcheck disable=SC2086
  run cmake --build --preset "$preset" -j "$jobs" ${targets[$preset]:+--target ${targets[$preset]}}
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
# pip builds a wheel from build-python/ (incremental) with the venv's scikit-build-core and nanobind
# (no isolated build environment to download), into build-python/dist: the prebuilt wheel a user
# installs without compiling (README). Its extension links liburing statically and loads libcurl,
# libcufile and libnccl at run time, so it needs only glibc and libstdc++: checked by installing it
# into a bare venv and importing it there. The tests run from outside the tree, on the wheel
# installed into the test venv. An error, a failure or no tests collected (exit 5) all end the script.
rm -rf build-python/dist
CMAKE_BUILD_PARALLEL_LEVEL=2 run python -m pip wheel -q --no-cache-dir --disable-pip-version-check --no-build-isolation --no-deps \
  -w build-python/dist .
wheel=$(ls build-python/dist/hbmio-*.whl)
run python -m pip install -q --no-cache-dir --disable-pip-version-check --no-deps --force-reinstall "$wheel"
bare=$(mktemp -d)
"$(python -c 'import sys; print(sys._base_executable)')" -m venv "$bare/venv"
run "$bare/venv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check --no-deps "$wheel"
(cd "$bare" && run venv/bin/python -c 'import hbmio; print("the wheel alone imports: hbmio", hbmio.__version__, hbmio.backends())')
rm -rf "$bare"
echo "prebuilt wheel: $wheel"
(cd "$prefix" && run python -m pytest -q -rs -p no:cacheprovider "$OLDPWD/python/tests")
stage "done"
echo "all test stages passed; durations:"
printf '%s\n' "${durations[@]}"
echo "$(printf '%6d' "$SECONDS") s  in all"
