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
grep -q "host (or cpu), pinned, cuda (the first GPU) or cuda:N" <<<"$out" || fail "bad --into message: $out"
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
out=$("$hbmio" ckpt info "$dir/a.bin" --json="$dir" 2>&1) && fail "--json naming a directory accepted"
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
grep -q "not a size" <<<"$out" || fail "a bad size says why: $out"

# Commands a user guesses get the command they meant; `help` works as in git.
for guess in "info:hbmio ckpt info" "load:hbmio ckpt load" "reed:hbmio read" "verify:hbmio ckpt verify"; do
  out=$("$hbmio" "${guess%%:*}" x 2>&1) && fail "'${guess%%:*}' accepted"
  grep -q "^hbmio: unknown command '${guess%%:*}'; did you mean '${guess#*:}'?" <<<"$out" || fail "unknown command: $out"
done
out=$("$hbmio" ckpt inspect x 2>&1) && fail "'ckpt inspect' accepted"
grep -q "unknown command 'inspect'; did you mean 'hbmio ckpt info'?" <<<"$out" || fail "unknown ckpt command: $out"
out=$("$hbmio" ckpt 2>&1) && fail "'ckpt' alone accepted"
grep -q "'hbmio ckpt' needs a command: info, load" <<<"$out" || fail "ckpt alone: $out"
out=$("$hbmio" xyzzy 2>&1) && fail "nonsense accepted"
grep -q "unknown command 'xyzzy'" <<<"$out" && ! grep -q "did you mean" <<<"$out" || fail "no guess for nonsense: $out"
# Options a user mistypes get the option they meant; a word far from every option gets no guess.
for guess in "read --int 3 x|hbmio read|--int|--into" "read x --verfy|hbmio read|--verfy|--verify" \
             "ckpt load x --int=cuda:0|hbmio ckpt load|--int|--into" "ckpt load x --backnd uring|hbmio ckpt load|--backnd|--backend"; do
  IFS='|' read -r words command typed meant <<<"$guess"
  # shellcheck disable=SC2086
  out=$("$hbmio" $words 2>&1) && fail "'$words' accepted"
  grep -q "^hbmio: unknown option '$typed'; did you mean '$meant'?" <<<"$out" || fail "unknown option in '$words': $out"
  grep -q "^'$command --help' lists" <<<"$out" || fail "unknown option in '$words' names its command's --help: $out"
done
out=$("$hbmio" read x --zzzzzz 2>&1) && fail "--zzzzzz accepted"
grep -q "^hbmio: unknown option '--zzzzzz'$" <<<"$out" || fail "no guess for a nonsense option: $out"
"$hbmio" read --help -v >/dev/null 2>&1 || fail "a known short option is not unknown"
# -V is --version, as in python, gcc and fio.
"$hbmio" -V | grep -q '^hbmio [0-9]' || fail "-V"
# bench takes --backend as well as --backends: every other command spells it so.
out=$("$hbmio" bench --backend posix --size 1MiB --runs 1 --warm --dir "$dir" --json "$dir/bench.json" 2>&1) \
  || fail "bench --backend: $out"
python3 -c "
import json; j=json.load(open('$dir/bench.json'))
assert [r['name'] for r in j['results']] == ['posix'], j['results']" || fail "bench --backend posix measured: $out"
# A host DNS does not know is said so, by name (.invalid never resolves: RFC 6761), not as a timeout.
if ldconfig -p 2>/dev/null | grep -q "libcurl.so.4 "; then
  out=$(env -u http_proxy -u https_proxy -u HTTP_PROXY -u HTTPS_PROXY -u ALL_PROXY -u all_proxy \
        "$hbmio" ckpt info https://no-such-host.invalid/model.safetensors 2>&1) && fail "an unresolvable host passed"
  grep -q "could not resolve host no-such-host.invalid" <<<"$out" && ! grep -qi "timed out" <<<"$out" \
    || fail "an unresolvable host: $out"
fi
"$hbmio" help | grep -q "^Usage: hbmio" || fail "hbmio help"
"$hbmio" help ckpt load | grep -q -- "--placement" || fail "hbmio help ckpt load"
out=$("$hbmio" read 2>&1) && fail "read without a file accepted"
grep -q "^hbmio: " <<<"$out" || fail "usage errors start with 'hbmio:': $out"

# --json alone is standard output and never takes the next word; --json=FILE and --json FILE.json write a file.
"$hbmio" backends --json | python3 -c "import json,sys; json.load(sys.stdin)" || fail "backends --json"
"$hbmio" doctor --json "$dir" | python3 -c "
import json,sys; j=json.load(sys.stdin); assert j['paths']==['$dir'], j['paths']" || fail "doctor --json PATH keeps PATH"
"$hbmio" backends --json="$dir/b1" >/dev/null && python3 -c "import json; json.load(open('$dir/b1'))" || fail "--json=FILE"
"$hbmio" backends --json "$dir/b2.json" >/dev/null && python3 -c "import json; json.load(open('$dir/b2.json'))" || fail "--json FILE.json"
"$hbmio" backends --json - | python3 -c "import json,sys; json.load(sys.stdin)" || fail "--json -"

# One size syntax (as Python's): MB is 10^6 bytes, MiB and M are 2^20; Mb (bits) is refused.
"$hbmio" ckpt generate "$dir/s.safetensors" --count 1 --tensor-size 1MB --dtype bf16 >/dev/null || fail "--tensor-size 1MB"
"$hbmio" ckpt info "$dir/s.safetensors" --json - | python3 -c "
import json,sys; t=json.load(sys.stdin)['tensors'][0]; assert t['dtype']=='BF16' and t['bytes']==10**6, t" || fail "--dtype bf16"
out=$("$hbmio" ckpt generate "$dir/s2.safetensors" --tensor-size 1Mb 2>&1) && fail "1Mb accepted"
grep -q "bits" <<<"$out" || fail "1Mb message: $out"

# --verify on a file without checksums (any other tool's): loaded and said to be unverified;
# --verify=strict refuses it, --verify=bytes compares with a plain read; failures are named so.
python3 - "$dir/plain.safetensors" <<'PY'
import json, struct, sys
header = json.dumps({"w": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]}}).encode()
header += b" " * (-len(header) % 8)
open(sys.argv[1], "wb").write(struct.pack("<Q", len(header)) + header + bytes(range(64)))
PY
out=$("$hbmio" ckpt load "$dir/plain.safetensors" --verify 2>&1) || fail "--verify of a file without checksums: $out"
grep -q "not verified: 1 file(s) of the checkpoint hold no hbmio checksums" <<<"$out" || fail "--verify unverified: $out"
"$hbmio" ckpt load "$dir/plain.safetensors" --verify --json | python3 -c "
import json,sys; j=json.load(sys.stdin)
assert j['verify']=='checksums' and j['verified'] is False and len(j['unverified_files'])==1, j" || fail "--verify JSON"
out=$("$hbmio" ckpt load "$dir/plain.safetensors" --verify=strict 2>&1) && fail "--verify=strict accepted a file without checksums"
grep -q "nothing to verify against" <<<"$out" || fail "--verify=strict message: $out"
"$hbmio" ckpt load "$dir/plain.safetensors" --verify=bytes | grep -q "identical to a plain read" || fail "--verify=bytes"
"$hbmio" ckpt checksum "$dir/plain.safetensors" --json | python3 -c "
import json,sys; assert json.load(sys.stdin)['files_rewritten']==1" || fail "ckpt checksum --json"
"$hbmio" ckpt load "$dir/plain.safetensors" --verify | grep -q "checksum matches" || fail "--verify with checksums"
python3 - "$dir/plain.safetensors" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(-1, 2); b = f.read(1); f.seek(-1, 2); f.write(bytes([b[0] ^ 1]))
PY
out=$("$hbmio" ckpt load "$dir/plain.safetensors" --verify 2>&1) && fail "a flipped byte passed --verify"
grep -q "verification failed" <<<"$out" && ! grep -q "Input/output error" <<<"$out" || fail "verify failure named: $out"

# A usage error quotes its arguments: a URL among them without its password or presigned query.
url='https://user:hun/ter2@127.0.0.1:9/k.safetensors?X-Amz-Signature=SECRETSIG'
out=$("$hbmio" ckpt info "$dir/a.bin" "$url" 2>&1) && fail "an extra argument was accepted"
grep -q "127.0.0.1:9/k.safetensors" <<<"$out" && ! grep -q "ter2\|SECRETSIG" <<<"$out" || fail "usage error: $out"
out=$("$hbmio" read "HTTPS://user:hunter2@127.0.0.1:9/k?X-Amz-Signature=SECRETSIG" 2>&1) && fail "read of a URL in capitals succeeded"
! grep -q "hunter2\|SECRETSIG" <<<"$out" || fail "a URL in capitals shown whole: $out"

# --json with a file name that is not UTF-8: the load's JSON, the odd byte replaced, and status 0.
odd=$dir/$'bad\xffname.safetensors'
"$hbmio" ckpt generate "$odd" --count 2 --tensor-size 4KiB > /dev/null
"$hbmio" ckpt load "$odd" --json - > "$dir/odd.json" || fail "ckpt load --json of a non-UTF-8 name failed"
python3 -c 'import json,sys; assert len(json.load(open(sys.argv[1]))["tensors"]) == 2' "$dir/odd.json" || fail "odd.json: $(cat "$dir/odd.json")"

# Result lines stay readable: the note is cut (its whole text is in -v and --json).
out=$("$hbmio" read "$dir/a.bin")
[ "$(wc -L <<<"$out")" -le 120 ] || fail "read's line is $(wc -L <<<"$out") columns: $out"
"$hbmio" read "$dir/a.bin" -v | grep -q "^  auto picked" || fail "read -v shows the note"
# doctor cuts its lines on a terminal only (`script` gives it one, where installed); piped, they are
# whole (tests/doctor_cli_test.sh checks that).
if command -v script >/dev/null; then
  out=$(script -qec "$(printf '%q doctor %q' "$hbmio" "$dir")" /dev/null | tr -d '\r')
  [ "$(wc -L <<<"$out")" -le 120 ] || fail "doctor's lines on a terminal reach $(wc -L <<<"$out") columns"
fi
echo "cli: all checks passed"
