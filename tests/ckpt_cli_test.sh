#!/usr/bin/env bash
# `hbmio ckpt` end to end: info/load/save/verify/checksum, interop with the reference safetensors
# implementation (Python, where installed), and crash safety under SIGKILL at many points.
set -euo pipefail
hbmio="$1"
dir=$(mktemp -d "${HBMIO_TEST_DIR:-/var/tmp}/hbmio-ckpt-XXXXXX")
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
fixtures="${HBMIO_FIXTURES:-}/safetensors"

"$hbmio" ckpt --help | grep -q verify || fail "ckpt --help"
"$hbmio" ckpt generate "$dir/a.safetensors" --force --count 5 --tensor-size 1MiB --dtype BF16 --seed 3 >/dev/null || fail "save"
"$hbmio" ckpt info "$dir/a.safetensors" --json - | python3 -c "
import json,sys; j=json.load(sys.stdin)
assert j['tensor_count']==5 and j['total_bytes']==5<<20 and j['checksums'] is True, j
assert all(t['dtype']=='BF16' and t['shape']==[512,1024] for t in j['tensors']), j" || fail "info --json"
"$hbmio" ckpt verify "$dir/a.safetensors" | grep -q "5 tensors verified" || fail "verify"
"$hbmio" ckpt verify "$dir/a.safetensors" --json - | python3 -c "
import json,sys; j=json.load(sys.stdin)
assert j['verified'] is True and j['tensors_checked']==5 and j['headers_checked']==1 and 'first_bad' not in j, j" \
  || fail "verify --json"
for b in posix uring auto; do
  "$hbmio" ckpt load "$dir/a.safetensors" --into pinned --backend $b --verify --json - | python3 -c "
import json,sys; j=json.load(sys.stdin); assert j['verified'] and len(j['tensors'])==5 and j['stats']['bytes']==5<<20, j" \
    || fail "load --backend $b"
done
"$hbmio" ckpt load "$dir/a.safetensors" --into pinned --runs 3 --reuse-memory --verify --json - | python3 -c "
import json,sys; j=json.load(sys.stdin); assert j['verified'] and j['reuse_memory'] and len(j['run_seconds'])==3, j" \
  || fail "load --runs 3 --reuse-memory"
"$hbmio" ckpt load "$dir/a.safetensors" --into pinned --runs 2 --drop-cache --json - | python3 -c "
import json,sys; j=json.load(sys.stdin); assert j['page_cache'] in ('drop_caches', 'posix_fadvise(DONTNEED)') and len(j['run_seconds'])==2, j" \
  || fail "load --drop-cache"
for placement in shard replicate; do
  "$hbmio" ckpt load "$dir/a.safetensors" --into host,pinned --placement $placement --verify --json - | python3 -c "
import json,sys; j=json.load(sys.stdin); p='$placement'
assert j['bytes_from_storage'] == 5<<20, j
assert [l['into'] for l in j['locations']] == ['host', 'pinned'], j
counts = [l['tensors'] for l in j['locations']]
assert (sum(counts) == 5 and all(counts)) if p == 'shard' else counts == [5, 5], j
assert j['bytes_between_locations'] == (0 if p == 'shard' else 5<<20), j" || fail "load --into host,pinned --placement $placement"
done
for bad in "--names ," "--into pinned,,host" "--into host,"; do
  # shellcheck disable=SC2086
  out=$("$hbmio" ckpt load "$dir/a.safetensors" $bad 2>&1) && fail "$bad was accepted"
  grep -q "an empty item" <<<"$out" || fail "$bad: $out"
done
out=$("$hbmio" ckpt load "$dir/a.safetensors" --into host,pinned --placement mirror 2>&1) && fail "a bad --placement was accepted"
echo "$out" | grep -q "shard or replicate" || fail "bad --placement: $out"

# Interop with the reference implementation, where it is installed.
if python3 -c 'import safetensors, numpy' 2>/dev/null; then
  python3 - "$dir/a.safetensors" <<'PY' || fail "the reference reader rejects hbmio's file"
import sys
from safetensors import safe_open
with safe_open(sys.argv[1], framework="numpy") as f:
    meta = f.metadata()
    assert meta["hbmio.checksum"] == "xxh3-64+header" and len(meta["hbmio.header_xxh3"]) == 16, meta
    names = sorted(f.keys())
    assert names == [f"layers.{i}.weight" for i in range(5)], names
    for n in names:
        assert f.get_slice(n).get_shape() == [512, 1024]
PY
  python3 - "$dir/ref.safetensors" <<'PY' || fail "writing a reference file"
import sys, numpy as np
from safetensors.numpy import save_file
rng = np.random.default_rng(7)
save_file({"w": rng.standard_normal((33, 7)).astype(np.float32), "b": np.arange(5, dtype=np.int64),
           "s": np.array(3.5, dtype=np.float64), "e": np.zeros((0, 3), dtype=np.uint8)}, sys.argv[1], metadata={"k": "v"})
PY
  "$hbmio" ckpt load "$dir/ref.safetensors" --into host >/dev/null || fail "loading a reference file"
  cp "$dir/ref.safetensors" "$dir/ref2.safetensors"
  "$hbmio" ckpt checksum "$dir/ref2.safetensors" >/dev/null && "$hbmio" ckpt verify "$dir/ref2.safetensors" >/dev/null \
    || fail "checksum of a reference file"
  python3 -c "
import sys, numpy as np
from safetensors.numpy import load_file
a, b = load_file('$dir/ref.safetensors'), load_file('$dir/ref2.safetensors')
assert a.keys() == b.keys() and all((a[k] == b[k]).all() and a[k].dtype == b[k].dtype for k in a)" || fail "checksum rewrite changed data"
  # Every dtype of the format, the sub-byte and float8 ones included, both ways through the
  # reference's framework-free (de)serializer: it reads hbmio's files with the dtype and shape
  # hbmio reports; hbmio loads, checksums (a crash-safe rewrite) and verifies the reference's,
  # and the rewrite leaves every tensor's bytes as the reference wrote them.
  dtypes="BOOL U8 I8 F8_E5M2 F8_E4M3 F8_E8M0 F8_E4M3FNUZ F8_E5M2FNUZ I16 U16 F16 BF16 I32 U32 F32 C64 F64 I64 U64 F4 F6_E2M3 F6_E3M2"
  for dt in $dtypes; do
    "$hbmio" ckpt generate "$dir/dt.safetensors" --force --count 2 --tensor-size 3KiB --dtype "$dt" --seed 5 >/dev/null \
      || fail "save --dtype $dt"
    "$hbmio" ckpt info "$dir/dt.safetensors" --json "$dir/dt.json" >/dev/null || fail "info --dtype $dt"
    python3 - "$dir/dt.safetensors" "$dir/dt.json" "$dt" <<'PY' || fail "the reference reads hbmio's $dt file wrongly"
import json, sys, safetensors
path, info, dtype = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3]
ref = dict(safetensors.deserialize(open(path, "rb").read()))
assert sorted(ref) == sorted(t["name"] for t in info["tensors"]), (sorted(ref), info)
for t in info["tensors"]:
    r = ref[t["name"]]
    assert r["dtype"] == dtype == t["dtype"] and r["shape"] == t["shape"], (r["dtype"], r["shape"], t)
    assert len(r["data"]) == 3072, len(r["data"])
PY
  done
  python3 - "$dir/every.safetensors" <<'PY' || fail "writing a reference file of every dtype"
# The reference writes every dtype but F6_* (it has no writer for those); since 0.8 through
# TensorSpec (torch-style names; F4 as float4_e2m1fn_x2, two values a byte, storage shape
# [3, 4] -> logical [3, 8]), before that through plain dicts.
import ctypes, random, sys, safetensors
names = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
         "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
         "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32",
         "F32": "float32", "C64": "complex64", "F64": "float64", "I64": "int64", "U64": "uint64", "F4": "float4_e2m1fn_x2"}
bits = {"BOOL": 8, "U8": 8, "I8": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
        "C64": 64, "F64": 64, "I64": 64, "U64": 64, "F4": 4}
rng = random.Random(11)
data = {d: rng.randbytes(24 * bits.get(d, 8) // 8) for d in names}
data["BOOL"] = bytes(b & 1 for b in data["BOOL"])
keep = {d: ctypes.create_string_buffer(b, len(b)) for d, b in data.items()}  # alive while serializing
if hasattr(safetensors, "TensorSpec"):
    tensors = {f"t.{d}": safetensors.TensorSpec(dtype=names[d], shape=[3, 4] if d == "F4" else [3, 8],
                                                data_ptr=ctypes.addressof(keep[d]), data_len=len(data[d]))
               for d in names}
else:
    tensors = {f"t.{d}": {"dtype": d, "shape": [3, 8], "data": data[d]} for d in names}
safetensors.serialize_file(tensors, sys.argv[1], metadata={"k": "v"})
got = dict(safetensors.deserialize(open(sys.argv[1], "rb").read()))
assert {k: (v["dtype"], v["shape"], bytes(v["data"])) for k, v in got.items()} == {
    f"t.{d}": (d, [3, 8], data[d]) for d in names}, "the reference does not read back what it wrote"
PY
  "$hbmio" ckpt load "$dir/every.safetensors" --into pinned >/dev/null || fail "loading the reference's file of every dtype"
  cp "$dir/every.safetensors" "$dir/every2.safetensors"
  "$hbmio" ckpt checksum "$dir/every2.safetensors" >/dev/null && "$hbmio" ckpt verify "$dir/every2.safetensors" >/dev/null \
    || fail "checksum of the reference's file of every dtype"
  python3 - "$dir/every.safetensors" "$dir/every2.safetensors" <<'PY' || fail "the checksum rewrite changed a tensor"
import sys, safetensors
a, b = (dict(safetensors.deserialize(open(p, "rb").read())) for p in sys.argv[1:])
assert a.keys() == b.keys() and len(a) == 20
for k in a:
    assert a[k] == b[k], k
PY
else
  echo "note: python3 safetensors/numpy not installed: interop checks skipped"
fi

# Errors name the file and the cause.
out=$("$hbmio" ckpt verify "$dir/missing.safetensors" 2>&1) && fail "missing file accepted"
grep -q "missing.safetensors" <<<"$out" || fail "missing-file message: $out"
if [ -d "$fixtures" ]; then
  out=$("$hbmio" ckpt verify "$fixtures/layers.safetensors" 2>&1) && fail "verify without checksums succeeded"
  grep -q "no hbmio checksums" <<<"$out" || fail "no-checksum message: $out"
fi
python3 -c "
import sys; d=bytearray(open('$dir/a.safetensors','rb').read()); d[-100]^=1; open('$dir/bad.safetensors','wb').write(d)"
out=$("$hbmio" ckpt verify "$dir/bad.safetensors" 2>&1) && fail "flipped byte not detected"
grep -q "layers.4.weight\|layers.0.weight\|layers" <<<"$out" || fail "flipped-byte message: $out"
out=$("$hbmio" ckpt verify "$dir/bad.safetensors" --json - 2>&1) && fail "verify --json of a damaged file exited 0"
python3 -c "
import json,sys; j=json.loads(sys.argv[1]); assert j['verified'] is False and 'starting at byte' in j['first_bad'], j" "$out" \
  || fail "verify --json of a damaged file: $out"
# checksum: refuses to certify the damage, recomputes with --force; leaves matching files alone.
out=$("$hbmio" ckpt checksum "$dir/bad.safetensors" 2>&1) && fail "checksum certified a damaged file"
grep -q "do not match" <<<"$out" && grep -q -- "bad.safetensors" <<<"$out" || fail "checksum of a damaged file: $out"
"$hbmio" ckpt checksum "$dir/bad.safetensors" --force | grep -q "checksums added to 1 file" || fail "checksum --force"
"$hbmio" ckpt verify "$dir/bad.safetensors" >/dev/null || fail "verify after checksum --force"
"$hbmio" ckpt checksum "$dir/bad.safetensors" | grep -q "already present and matching" || fail "checksum of a good file"
# Two checksums of one sharded checkpoint at once take turns on each file (its flock): both
# succeed, between them every shard is rewritten once, and the checkpoint verifies.
"$hbmio" ckpt generate "$dir/twice" --count 12 --tensor-size 1MiB --max-shard-size 2MiB --no-checksums >/dev/null
"$hbmio" ckpt checksum "$dir/twice" >"$dir/twice1.out" 2>&1 & p1=$!
"$hbmio" ckpt checksum "$dir/twice" >"$dir/twice2.out" 2>&1 & p2=$!
wait $p1 || fail "the first of two concurrent checksums: $(cat "$dir/twice1.out")"
wait $p2 || fail "the second of two concurrent checksums: $(cat "$dir/twice2.out")"
"$hbmio" ckpt verify "$dir/twice" >/dev/null || fail "after two concurrent checksums the checkpoint does not verify"
! ls -A "$dir/twice" | grep -q hbmio-tmp || fail "two concurrent checksums left a temporary: $(ls -A "$dir/twice")"
# Usage errors exit 1, like every other error; --max-shard-size 0 is one.
set +e
"$hbmio" ckpt generate "$dir/z.safetensors" --force --count 1 --tensor-size 4KiB --max-shard-size 0 >/dev/null 2>&1; rc1=$?
"$hbmio" ckpt load "$dir/a.safetensors" --no-such-flag >/dev/null 2>&1; rc2=$?
"$hbmio" frobnicate >/dev/null 2>&1; rc3=$?
set -e
[ "$rc1 $rc2 $rc3" = "1 1 1" ] || fail "usage errors exit 1 (got $rc1 $rc2 $rc3)"
[ ! -e "$dir/z.safetensors" ] || fail "--max-shard-size 0 wrote something"

# Ctrl-C (SIGINT) or SIGTERM while a save writes: the save stops before it publishes, the process
# ends by that signal (128 + N), nothing of the save is left, and the old checkpoint is intact.
interrupt_save() {  # NAME SIGNAL [save flags...]
  local name=$1 sig=$2; shift 2
  "$hbmio" ckpt generate "$dir/$name" --force --count 2 --tensor-size 1MiB "$@" >/dev/null || fail "first save of $name"
  "$hbmio" ckpt generate "$dir/$name" --force --count 32 --tensor-size 16MiB --backend posix "$@" >/dev/null 2>"$dir/stop.err" &
  local pid=$! i
  # Writing: the save holds its new file open (unnamed, O_TMPFILE: "DIR/#N (deleted)"), or its
  # temporary directory exists.
  writing() { ls -l "/proc/$pid/fd" 2>/dev/null | grep -q -- "$dir/#" || ls -A "$dir" | grep -q "^\.$name\.hbmio-tmp-"; }
  for i in $(seq 500); do writing && break; sleep 0.02; done
  writing || fail "$name: the save never started writing"
  kill -"$sig" $pid
  local rc=0
  wait $pid || rc=$?
  [ "$rc" = $((128 + $(kill -l "$sig"))) ] || fail "$name: SIG$sig gave exit status $rc: $(cat "$dir/stop.err")"
  grep -q "holds what it held before" "$dir/stop.err" || fail "$name: message: $(cat "$dir/stop.err")"
  ! ls -A "$dir" | grep -q "hbmio-tmp" || fail "$name: a temporary stayed after SIG$sig: $(ls -A "$dir")"
  "$hbmio" ckpt verify "$dir/$name" >/dev/null || fail "$name: the old checkpoint does not verify after SIG$sig"
  "$hbmio" ckpt info "$dir/$name" --json - | python3 -c "
import json,sys; assert json.load(sys.stdin)['tensor_count'] == 2" || fail "$name: not the old checkpoint"
}
interrupt_save int.safetensors INT
interrupt_save term.safetensors TERM
interrupt_save int-sharded INT --max-shard-size 64MiB

# Crash safety: kill -9 the saver at many points; the final name always holds a complete old or
# new checkpoint (verify passes), and the next save leaves no temporary file.
"$hbmio" ckpt generate "$dir/c.safetensors" --force --count 16 --tensor-size 2MiB --seed 1 >/dev/null
for i in $(seq 1 20); do
  "$hbmio" ckpt generate "$dir/c.safetensors" --force --count 16 --tensor-size 2MiB --seed $((i + 100)) >/dev/null 2>&1 &
  pid=$!
  sleep "0.0$(( (i * 7) % 10 ))"
  kill -9 $pid 2>/dev/null || true
  wait $pid 2>/dev/null || true
  "$hbmio" ckpt verify "$dir/c.safetensors" >/dev/null || fail "after SIGKILL $i the checkpoint does not verify"
done
"$hbmio" ckpt generate "$dir/c.safetensors" --force --count 2 --tensor-size 4KiB >/dev/null
[ -z "$(ls -A "$dir" | grep hbmio-tmp || true)" ] || fail "temporary files left after the next save"
# The same for a sharded save into a directory: every kill leaves a complete old or new set.
"$hbmio" ckpt generate "$dir/sharded" --force --count 12 --tensor-size 2MiB --max-shard-size 5MiB >/dev/null
[ "$(ls "$dir/sharded" | grep -c 'of-00006.safetensors')" = 6 ] || fail "sharded save: expected 6 shards (2 tensors of 2 MiB each), got: $(ls "$dir/sharded")"
for i in $(seq 1 8); do
  "$hbmio" ckpt generate "$dir/sharded" --force --count 12 --tensor-size 2MiB --max-shard-size $(( (i % 3 + 1) * 3 ))MiB --seed $i >/dev/null 2>&1 &
  pid=$!
  sleep "0.0$(( (i * 3) % 10 ))"
  kill -9 $pid 2>/dev/null || true
  wait $pid 2>/dev/null || true
  "$hbmio" ckpt verify "$dir/sharded" >/dev/null || fail "after SIGKILL $i the sharded checkpoint does not verify"
done
# Any other file given as a checkpoint is said to be no safetensors file, the figures kept.
printf 'plain text, not a checkpoint\n' > "$dir/notes.txt"
out=$("$hbmio" ckpt info "$dir/notes.txt" 2>&1) && fail "ckpt info of a text file passed"
grep -q "not a safetensors file: header too large: length prefix [0-9]* exceeds 100000000" <<<"$out" \
  || fail "ckpt info of a text file: $out"
# Without a GPU, loading into one says so and why, without an [offset, length] that means nothing there.
if "$hbmio" backends --json - | python3 -c "import json,sys; sys.exit(json.load(sys.stdin)['cuda']['devices'] > 0)"; then
  out=$("$hbmio" ckpt load "$dir/a.safetensors" --into cuda:0 2>&1) && fail "ckpt load --into cuda:0 passed without a GPU"
  grep -q "^hbmio: allocate cuda:0: .*this machine has no GPU (.\+)" <<<"$out" || fail "--into cuda:0 without a GPU: $out"
  ! grep -q "offset\|length" <<<"$out" || fail "--into cuda:0 without a GPU names a range: $out"
fi
echo "ckpt cli: all checks passed"
