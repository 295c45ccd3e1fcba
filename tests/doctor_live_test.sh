#!/usr/bin/env bash
# The doctor's cuFile verdict against what the cufile backend really does, on this machine:
#   verdict "unusable"            -> `hbmio read --backend cufile` into GPU memory fails;
#   verdict "registered ... mode" -> the same read succeeds, and the bytes match a plain read.
# And `auto` moves the bytes either way. Runs on CI (no GPU: unusable, and the read fails) and on
# the GPU machine (label gpu there in spirit: it says which case it checked).
# Usage: doctor_live_test.sh HBMIO_BINARY
set -euo pipefail
hbmio=$1
work=$(mktemp -d "${HBMIO_TEST_DIR:-/var/tmp}/doctor-live.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

head -c 3000000 /dev/urandom > "$work/data.bin"
set +e
"$hbmio" doctor "$work/data.bin" --json "$work/doctor.json" >/dev/null
doctor_status=$?
set -e
[ "$doctor_status" -le 1 ] || fail "doctor exited with $doctor_status"
verdict=$(python3 - "$work/doctor.json" "$work/data.bin" <<'PY'
import json, sys
checks = {c["id"]: c for c in json.load(open(sys.argv[1]))["checks"]}
v = checks["gds.verdict:" + sys.argv[2]]
print(v["status"], v["found"], sep="\t")
PY
)
status=${verdict%%$'\t'*}
found=${verdict#*$'\t'}
echo "doctor: $status: $found"

set +e
read_out=$("$hbmio" read "$work/data.bin" --into cuda:0 --backend cufile --verify 2>&1)
read_status=$?
set -e
echo "cufile read (exit $read_status): $(echo "$read_out" | tail -1)"

case "$found" in
  "cuFile unusable here:"*)
    [ "$read_status" -ne 0 ] || fail "doctor says cuFile is unusable, but the cufile backend read the file" ;;
  "cuFile registered the file"*)
    [ "$read_status" -eq 0 ] || fail "doctor says cuFile registers the file, but the cufile read failed: $read_out" ;;
  "not tried:"*)
    [ "$read_status" -ne 0 ] || fail "doctor could not try cuFile, but the cufile backend read the file" ;;
  *) fail "unexpected verdict text: $found" ;;
esac

# Whatever cuFile does, auto delivers the bytes (into the GPU where there is one, else the host).
into=host
[ "$(python3 - <<'PY' 2>/dev/null
import ctypes
try:
    n = ctypes.c_int(0)
    print(1 if ctypes.CDLL("libcuda.so.1").cuInit(0) == 0 and ctypes.CDLL("libcuda.so.1").cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0 else 0)
except OSError:
    print(0)
PY
)" = 1 ] && into=cuda:0
"$hbmio" read "$work/data.bin" --into $into --backend auto --verify >/dev/null || fail "auto read into $into"
# A directory the user cannot write (a mounted dataset): O_DIRECT is judged on a file in it, not
# reported missing. As root, through an unprivileged user; skipped where setpriv is missing. The
# directory and a copy of the binary go under /tmp (world-searchable): the checkout's own parent
# directories may be closed to other users (a clone under a mode-700 temporary directory).
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null; then
  shared=$(mktemp -d /tmp/hbmio-doctor-ro.XXXXXX)
  trap 'rm -rf "$work" "$shared"' EXIT
  chmod 755 "$shared" && cp "$hbmio" "$shared/hbmio" && chmod 755 "$shared/hbmio"
  ro="$shared/read-only"
  mkdir -p "$ro" && head -c 65536 /dev/urandom > "$ro/weights.bin" && chmod 555 "$ro" && chmod 444 "$ro/weights.bin"
  setpriv --reuid=65534 --regid=65534 --clear-groups "$shared/hbmio" doctor "$ro" --json - > "$work/ro.json" 2>/dev/null || true
  python3 - "$work/ro.json" <<'PY' || fail "read-only directory: $(cat "$work/ro.json")"
import json, sys
checks = {c["id"].split(":")[0]: c for c in json.load(open(sys.argv[1]))["checks"]}
o_direct, auto = checks["storage.o_direct"], checks["summary.auto"]
assert "weights.bin: the directory is read-only" in o_direct["found"], o_direct
assert "no O_DIRECT here" not in auto["found"] or o_direct["status"] == "FAIL", auto
PY
fi
echo "PASS: the doctor's verdict matches the cufile backend ($status); auto read into $into verified"
