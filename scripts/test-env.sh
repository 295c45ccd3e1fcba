#!/usr/bin/env bash
# The Python environment of the tests: a virtual environment in build-python/venv made from the
# system's own Python (PEP 668: Debian's python3 refuses pip installs outside one), with the pinned
# packages of python/tests/requirements.txt. Idempotent: a stamp of the requirements' hash makes a
# second run cost a second. Prints the venv's path on its last line.
# Needs python3-venv and python3-dev (scripts/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=build-python/venv
requirements=python/tests/requirements.txt
# Debian's interpreter, not whichever python3 comes first on PATH (pyenv, conda): the one a
# newcomer on a fresh Debian 12 has.
python=/usr/bin/python3
[ -x "$python" ] || python=$(command -v python3)
stamp="$venv/.requirements.sha256"
want=$(sha256sum "$requirements" | cut -d' ' -f1)

# The reference's next release (its release candidate) in a folder of its own, beside the venv's
# pinned one: python/tests/test_conformance.py runs its cases against it in a child process with
# this folder first on sys.path (the venv keeps 0.8, which the other tests compare with). A stamp
# of the pin makes a second run cost nothing, and a new pin replace the folder.
reference_next=safetensors==0.9.0rc1
reference_next_dir=build-python/safetensors-0.9
install_reference_next() {
  [ "$(cat "$reference_next_dir/.stamp" 2>/dev/null)" = "$reference_next" ] && return 0
  echo "+ pip install $reference_next into $reference_next_dir" >&2
  rm -rf "$reference_next_dir"
  "$venv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check --no-deps \
    --target "$reference_next_dir" "$reference_next" >&2
  echo "$reference_next" > "$reference_next_dir/.stamp"
}

if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  install_reference_next
  echo "$venv"
  exit 0
fi
start=$SECONDS
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv" >&2
echo "+ pip install -r $requirements into $venv (about 5 GB with torch; 2-4 minutes on first run)" >&2
# --no-cache-dir: pip's cache would hold a second copy of those gigabytes.
"$venv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check -r "$requirements" >&2
# The real cufile.h (and libcufile) of the GPU machine's version, for the cuFile ABI test: in a
# folder of its own, as torch's CUDA wheels require another nvidia-cufile in the venv
# (tests/cufile_tests.cmake finds it through HBMIO_CUFILE_WHEEL, which scripts/test.sh sets).
"$venv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check --no-deps --upgrade \
  --target build-python/cufile-1.15 nvidia-cufile==1.15.1.6 >&2
install_reference_next
echo "$want" > "$stamp"
echo "test environment: $((SECONDS - start)) s" >&2
echo "$venv"
