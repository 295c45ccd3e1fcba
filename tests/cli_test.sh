#!/usr/bin/env bash
# End-to-end checks of the hbmio command: exit codes, messages naming the file, valid JSON.
set -euo pipefail
hbmio="$1"
dir=$(mktemp -d "${HBMIO_TEST_DIR:-/var/tmp}/hbmio-cli-XXXXXX")
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$hbmio" --version | grep -q '^hbmio [0-9]' || fail "--version"
"$hbmio" --help | grep -q 'backends' || fail "--help lists the subcommands"
"$hbmio" read --help | grep -q -- '--into' || fail "read --help"

"$hbmio" write-random "$dir/a.bin" --size 3MiB --seed 7 --sync --verify >/dev/null || fail "write --verify"
[ "$(stat -c %s "$dir/a.bin")" = 3145728 ] || fail "written size"
for b in posix uring auto; do
  "$hbmio" read "$dir/a.bin" --backend $b --into pinned --offset 4097 --verify --json "$dir/r.json" >/dev/null \
    || fail "read --backend $b"
  python3 -c "
import json,sys; j=json.load(open('$dir/r.json'))
assert j['verified'] is True and j['length']==3145728-4097 and j['stats']['bytes']==j['length'], j
assert j['stats']['backend'] in ('posix','uring'), j" || fail "read JSON ($b)"
done

"$hbmio" backends --json - | python3 -c "
import json,sys; j=json.load(sys.stdin); names=[b['name'] for b in j['backends']]
assert names==['posix','uring','cufile','auto'], names
assert all(b['detail'] for b in j['backends'])" || fail "backends --json"

# Errors: non-zero exit, message names the file and the cause.
out=$("$hbmio" read "$dir/missing.bin" 2>&1) && fail "missing file accepted"
grep -q "missing.bin" <<<"$out" && grep -q "No such file" <<<"$out" || fail "missing file message: $out"
out=$("$hbmio" read "$dir/a.bin" --offset 3MiB --length 1 2>&1) && fail "read past EOF accepted"
grep -q "past the end" <<<"$out" || fail "past-EOF message: $out"
out=$("$hbmio" read "$dir/a.bin" --backend warp 2>&1) && fail "unknown backend accepted"
grep -q "unknown backend" <<<"$out" || fail "unknown backend message: $out"
out=$("$hbmio" read "$dir/a.bin" --into disk 2>&1) && fail "bad --into accepted"
grep -q "host, pinned or cuda:N" <<<"$out" || fail "bad --into message: $out"
out=$("$hbmio" read "$dir/a.bin" --length 1TiB 2>&1) && fail "a range past EOF accepted"
grep -q "past the end of the file" <<<"$out" || fail "a range past EOF is refused before allocating: $out"
mkfifo "$dir/fifo"
out=$(timeout 20 "$hbmio" read "$dir/fifo" 2>&1) && fail "a FIFO accepted"
grep -q "not a regular file" <<<"$out" || fail "FIFO (read): $out"
out=$(timeout 20 "$hbmio" ckpt info "$dir/fifo" 2>&1) && fail "a FIFO accepted"
grep -q "not a regular file" <<<"$out" || fail "FIFO (ckpt info): $out"
# --json and --chart destinations are checked before any work.
out=$("$hbmio" read "$dir/a.bin" --json "$dir/no/such/dir/r.json" 2>&1) && fail "--json into a missing directory accepted"
grep -q "no/such/dir" <<<"$out" && grep -q "No such file" <<<"$out" || fail "--json message: $out"
out=$("$hbmio" ckpt info "$dir/a.bin" --json "$dir" 2>&1) && fail "--json naming a directory accepted"
grep -q "is a directory" <<<"$out" || fail "--json directory message: $out"
out=$("$hbmio" bench --size 1MiB --chart "$dir/no/such/c.svg" 2>&1) && fail "--chart into a missing directory accepted"
grep -q "no/such" <<<"$out" || fail "--chart message: $out"
# HBMIO_BACKEND is every command's default backend; an explicit --backend wins over it.
HBMIO_BACKEND=posix "$hbmio" read "$dir/a.bin" --json - | python3 -c "
import json,sys; assert json.load(sys.stdin)['stats']['backend'] == 'posix'" || fail "HBMIO_BACKEND (read)"
HBMIO_BACKEND=posix "$hbmio" read "$dir/a.bin" --backend uring --json - | python3 -c "
import json,sys; assert json.load(sys.stdin)['stats']['backend'] == 'uring'" || fail "--backend over HBMIO_BACKEND"
"$hbmio" ckpt generate "$dir/e.safetensors" --force --count 2 --tensor-size 64KiB >/dev/null
HBMIO_BACKEND=posix "$hbmio" ckpt load "$dir/e.safetensors" --json - | python3 -c "
import json,sys; assert json.load(sys.stdin)['stats']['backend'] == 'posix'" || fail "HBMIO_BACKEND (ckpt load)"
out=$(HBMIO_BACKEND=warp "$hbmio" ckpt load "$dir/e.safetensors" 2>&1) && fail "HBMIO_BACKEND=warp accepted"
grep -q "unknown backend" <<<"$out" || fail "HBMIO_BACKEND=warp message: $out"
out=$("$hbmio" doctor --root "$dir/no-such-tree" 2>&1) && fail "doctor --root of a missing directory passed"
grep -q "no-such-tree" <<<"$out" || fail "doctor --root message: $out"
out=$("$hbmio" write-random "$dir/w.bin" --size 0x100 2>&1) && fail "a hex size accepted"
grep -q -- "--size" <<<"$out" || fail "a bad size names its option: $out"
echo "cli: all checks passed"
