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
"$hbmio" ckpt save "$dir/a.safetensors" --count 5 --tensor-size 1MiB --dtype BF16 --seed 3 >/dev/null || fail "save"
"$hbmio" ckpt info "$dir/a.safetensors" --json - | python3 -c "
import json,sys; j=json.load(sys.stdin)
assert j['tensor_count']==5 and j['total_bytes']==5<<20 and j['checksums'] is True, j
assert all(t['dtype']=='BF16' and t['shape']==[512,1024] for t in j['tensors']), j" || fail "info --json"
"$hbmio" ckpt verify "$dir/a.safetensors" | grep -q "5 tensors verified" || fail "verify"
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

# Crash safety: kill -9 the saver at many points; the final name always holds a complete old or
# new checkpoint (verify passes), and the next save leaves no temporary file.
"$hbmio" ckpt save "$dir/c.safetensors" --count 16 --tensor-size 2MiB --seed 1 >/dev/null
for i in $(seq 1 20); do
  "$hbmio" ckpt save "$dir/c.safetensors" --count 16 --tensor-size 2MiB --seed $((i + 100)) >/dev/null 2>&1 &
  pid=$!
  sleep "0.0$(( (i * 7) % 10 ))"
  kill -9 $pid 2>/dev/null || true
  wait $pid 2>/dev/null || true
  "$hbmio" ckpt verify "$dir/c.safetensors" >/dev/null || fail "after SIGKILL $i the checkpoint does not verify"
done
"$hbmio" ckpt save "$dir/c.safetensors" --count 2 --tensor-size 4KiB >/dev/null
[ -z "$(ls -A "$dir" | grep hbmio-tmp || true)" ] || fail "temporary files left after the next save"
# The same for a sharded save into a directory: every kill leaves a complete old or new set.
"$hbmio" ckpt save "$dir/sharded" --count 12 --tensor-size 2MiB --max-shard-size 5MiB >/dev/null
[ "$(ls "$dir/sharded" | grep -c 'of-00006.safetensors')" = 6 ] || fail "sharded save: expected 6 shards (2 tensors of 2 MiB each), got: $(ls "$dir/sharded")"
for i in $(seq 1 8); do
  "$hbmio" ckpt save "$dir/sharded" --count 12 --tensor-size 2MiB --max-shard-size $(( (i % 3 + 1) * 3 ))MiB --seed $i >/dev/null 2>&1 &
  pid=$!
  sleep "0.0$(( (i * 3) % 10 ))"
  kill -9 $pid 2>/dev/null || true
  wait $pid 2>/dev/null || true
  "$hbmio" ckpt verify "$dir/sharded" >/dev/null || fail "after SIGKILL $i the sharded checkpoint does not verify"
done
echo "ckpt cli: all checks passed"
