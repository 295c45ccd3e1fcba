#!/usr/bin/env bash
# Installs what hbmio needs to build and test on Debian 12: the compiler tool chain is assumed
# (g++ 12, CMake >= 3.25); the CUDA toolkit is optional and used when /usr/local/cuda exists.
# Idempotent: packages already present are skipped, so repeated runs cost seconds.
set -euo pipefail

debian_packages=(
  build-essential cmake ninja-build pkg-config
  liburing-dev          # io_uring backend, linked statically
  nlohmann-json3-dev    # safetensors headers, --json output
  libcli11-dev          # command line
  libfmt-dev            # formatting (used header-only: no run-time dependency)
  libxxhash-dev         # per-tensor checksums
  libgtest-dev          # tests
  libcurl4-openssl-dev  # remote URLs (S3, HTTP): curl.h at build time; libcurl.so.4 is loaded at run time
  fio                   # the storage ceiling the benchmarks compare against
  strace                # tests/durability_test.sh: the order of a save's fsyncs and renames
  fuse3                 # python/tests/test_power_loss.py: libfuse3 and fusermount3 for CrashFS
  python3-pip
  python3-dev python3-venv  # the Python package (nanobind extension, tested in a venv)
)

missing=()
for p in "${debian_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The real cufile.h (and libcufile) from NVIDIA's wheel: the ABI test checks hbmio's own
# declarations of the cuFile C API against it. Pinned to the version on the GPU machine.
# safetensors + numpy: the reference implementation the format tests compare hbmio's writer against.
python3 - <<'PY' 2>/dev/null || python3 -m pip install -q --disable-pip-version-check nvidia-cufile==1.15.1.6 safetensors numpy
import importlib.util, sys
spec = importlib.util.find_spec("nvidia")
have_cufile = spec and any(__import__("os").path.exists(p + "/cu13/include/cufile.h") for p in spec.submodule_search_locations)
have_reference = all(importlib.util.find_spec(m) for m in ("safetensors", "numpy"))
sys.exit(0 if have_cufile and have_reference else 1)
PY
