#!/usr/bin/env bash
# Installs what hbmio needs to build on Debian 12, as Debian packages (apt-get, through sudo when
# not root): the compiler tool chain, CMake, and the libraries below. The CUDA toolkit is optional
# and used when /usr/local/cuda exists. Python packages never go into the system's Python (PEP 668
# refuses them there): the tests' own go into a virtual environment (scripts/test-env.sh), the
# hbmio package into the user's (README). Idempotent: packages already present are skipped.
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
  python3-dev python3-venv  # the Python package (nanobind extension) and the tests' virtual environment
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
