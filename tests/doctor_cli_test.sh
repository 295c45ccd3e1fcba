#!/usr/bin/env bash
# hbmio doctor from the command line: --help, the JSON schema, --root on a recorded tree, exit
# statuses, and a clear error for a PATH that does not exist.
# Usage: doctor_cli_test.sh HBMIO_BINARY FIXTURES_DIR
set -euo pipefail
hbmio=$1
fixtures=${2:-}
work=$(mktemp -d "${HBMIO_TEST_DIR:-/tmp}/doctor-cli.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# Every check has exactly {id, group, status, found, expected, fix}, strings, status one of four.
check_schema() {
  python3 - "$1" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
assert report["command"] == "doctor", report.keys()
checks = report["checks"]
assert checks, "no checks"
for c in checks:
    assert set(c) == {"id", "group", "status", "found", "expected", "fix"}, c
    assert all(isinstance(v, str) for v in c.values()), c
    assert c["status"] in ("PASS", "WARN", "FAIL", "INFO"), c
    assert c["group"] in ("GPUs", "Storage", "Fabric", "Topology", "GDS", "Summary", ), c
assert report["failed"] == any(c["status"] == "FAIL" for c in checks)
assert sum(report["counts"].values()) == len(checks)
PY
}

"$hbmio" doctor --help | grep -q -- "--root" || fail "--help does not explain --root"

# The live machine: 0 or 1, never a crash; valid JSON on stdout with --json -.
set +e
"$hbmio" doctor "$work" --json "$work/live.json" > "$work/live.txt"
status=$?
set -e
[[ $status -le 1 ]] || fail "live run exited $status"
check_schema "$work/live.json" || fail "live JSON schema"
grep -q "^Summary" "$work/live.txt" || fail "no Summary group in the checklist"
grep -q "summary.auto:$work" "$work/live.txt" || fail "no auto verdict for $work"
# Output that is not a terminal is never cut: every finding shown (the Summary's above all), and the
# expectation and fix of every WARN and FAIL, stand whole in the text, as in the JSON.
python3 - "$work/live.json" "$work/live.txt" <<'PY' || fail "the piped checklist cuts lines"
import json, sys
text = open(sys.argv[2]).read()
assert " ...\n" not in text, [l for l in text.splitlines() if l.endswith(" ...")]
for c in json.load(open(sys.argv[1]))["checks"]:
    if c["id"] not in text:
        continue  # folded: the fabric and GDS checks of a machine without an NVIDIA GPU
    assert c["found"] in text, c
    if c["status"] in ("WARN", "FAIL"):
        assert c["expected"] in text and c["fix"] in text, c
PY
set +e
"$hbmio" doctor "$work" --json - > "$work/stdout.json"
set -e
check_schema "$work/stdout.json" || fail "--json - is not the JSON report alone"

# A missing PATH: FAIL, exit 1, and a message naming it.
set +e
"$hbmio" doctor /nonexistent/hbmio-doctor-path > "$work/missing.txt" 2> "$work/missing.err"
status=$?
set -e
[[ $status -eq 1 ]] || fail "missing PATH exited $status"
grep -q "cannot stat /nonexistent/hbmio-doctor-path: No such file or directory" "$work/missing.err" || fail "unclear error: $(cat "$work/missing.err")"

# A constructed tree with a malformed cufile.json: exit 1; the same tree fixed: exit 0.
mkdir -p "$work/tree/etc" "$work/tree/proc" "$work/tree/sys/kernel/iommu_groups"
echo "root=/dev/vda" > "$work/tree/proc/cmdline"
echo '{ "properties": { "allow_compat_mode": tru } }' > "$work/tree/etc/cufile.json"
set +e
"$hbmio" doctor --root "$work/tree" --json "$work/tree.json" > /dev/null
status=$?
set -e
[[ $status -eq 1 ]] || fail "malformed cufile.json exited $status"
python3 -c "import json,sys; c=[x for x in json.load(open(sys.argv[1]))['checks'] if x['id']=='gds.cufile_json'][0]; assert c['status']=='FAIL', c" "$work/tree.json"
printf '// comment\n{ "properties": { "allow_compat_mode": true } }\n' > "$work/tree/etc/cufile.json"
"$hbmio" doctor --root "$work/tree" > "$work/tree.txt" || fail "clean constructed tree exited $?"
grep -q "skipped: --root given" "$work/tree.txt" || fail "live probes not marked as skipped"
# --json carries the GDS mode checks: P2PDMA as a mode, the cufile.json audit, the container, each PATH's mode.
mkdir -p "$work/tree/proc/self" && echo "22 1 254:0 / / rw,relatime - ext4 /dev/vda rw" > "$work/tree/proc/self/mountinfo"
"$hbmio" doctor --root "$work/tree" / --json "$work/modes.json" > /dev/null || fail "constructed tree with a PATH exited $?"
check_schema "$work/modes.json"
python3 - "$work/modes.json" <<'PY' || fail "--json lacks the GDS mode checks"
import json, sys
ids = {c["id"] for c in json.load(open(sys.argv[1]))["checks"]}
for want in ("gds.p2pdma_mode", "gds.cufile_audit", "gds.container", "gds.mode:/"):
    assert want in ids, (want, sorted(ids))
PY

# A recorded tree with NVMe controllers.
archive="$fixtures/sysfs/libnvme/tree-pcie.tar.xz"
if [[ -f "$archive" ]]; then
  mkdir -p "$work/nvme"
  tar -xf "$archive" -C "$work/nvme" 2>/dev/null || true
  set +e
  "$hbmio" doctor --root "$work/nvme" --json "$work/nvme.json" > "$work/nvme.txt"
  status=$?
  set -e
  [[ $status -eq 0 ]] || fail "tree-pcie exited $status"
  check_schema "$work/nvme.json"
  grep -q "storage.nvme:nvme1 .*transport pcie, address 052e:78:00.0" "$work/nvme.txt" || fail "nvme1 not shown: $(cat "$work/nvme.txt")"
else
  echo "skipped the recorded-tree case: $archive not found"
fi
# --explain: a real read of a file, the way it took and why, and the advice; JSON and text agree.
head -c 300000 /dev/urandom > "$work/explained.bin"
set +e
"$hbmio" doctor --explain "$work/explained.bin" --json "$work/explain.json" > "$work/explain.txt"
status=$?
set -e
[[ $status -le 1 ]] || fail "--explain exited $status"
python3 - "$work/explain.json" "$work/explained.bin" <<'PY' || fail "--explain JSON: $(cat "$work/explain.json")"
import json, sys
e = json.load(open(sys.argv[1]))
assert e["command"] == "doctor --explain" and e["file"] == sys.argv[2], e
assert e["stats"]["bytes"] == 300000, e["stats"]
(p,) = e["stats"]["paths"]
assert set(p) == {"file", "path", "reason", "bytes", "bytes_direct"}, p
assert p["file"] == sys.argv[2] and p["bytes"] == 300000 and p["reason"], p
assert p["path"] in ("gds-nvidia-fs", "gds-p2pdma", "cufile-compat", "uring", "posix"), p
assert e["advice"] and e["advice"][-1]["id"] == "summary.auto:" + sys.argv[2], e["advice"]
assert e["summary"].startswith("Read "), e["summary"]
PY
grep -q "^Path taken" "$work/explain.txt" || fail "--explain text has no 'Path taken': $(cat "$work/explain.txt")"
grep -q "^What bounds it" "$work/explain.txt" || fail "--explain text has no advice section"
set +e
"$hbmio" doctor --explain "$work/missing.bin" > "$work/missing.txt" 2>&1
status=$?
set -e
[[ $status -eq 1 ]] && grep -q "missing.bin" "$work/missing.txt" || fail "--explain of a missing file: status $status, $(cat "$work/missing.txt")"

# A checkpoint's index given after --json is a PATH to judge, never the output: it stays as it was.
printf '{"metadata": {}, "weight_map": {}}\n' > "$work/model.safetensors.index.json"
cp "$work/model.safetensors.index.json" "$work/index.before"
"$hbmio" doctor --json "$work/model.safetensors.index.json" > "$work/index.txt" 2>&1 || true
cmp -s "$work/model.safetensors.index.json" "$work/index.before" || fail "doctor --json INDEX overwrote the index"
python3 -c 'import json,sys; json.loads(sys.stdin.read())' < "$work/index.txt" || fail "doctor --json INDEX: no JSON on stdout"

# A URL given as PATH (a password, a presigned query): neither the checklist nor its JSON shows them.
url='http://user:hunter2@127.0.0.1:9/k.safetensors?X-Amz-Signature=SECRETSIG'
"$hbmio" doctor "$url" > "$work/url.txt" 2>&1 || true
"$hbmio" doctor "$url" --json - > "$work/url.json" 2>/dev/null || true
grep -q "127.0.0.1:9/k.safetensors" "$work/url.txt" || fail "doctor of a URL does not name it: $(cat "$work/url.txt")"
! grep -l "hunter2\|SECRETSIG" "$work/url.txt" "$work/url.json" || fail "doctor shows a URL's secrets"

# A FIFO as PATH is judged, not waited on (its open would wait for a writer).
mkfifo "$work/fifo.safetensors"
set +e
timeout 20 "$hbmio" doctor "$work/fifo.safetensors" > "$work/fifo.txt" 2>&1
status=$?
set -e
[[ $status -le 1 ]] || fail "doctor of a FIFO: status $status (124: it hung)"
out=$(timeout 20 "$hbmio" cache add "$work/fifo.safetensors" --socket "$work/no.sock" 2>&1) && fail "cache add of a FIFO succeeded"
grep -q "not a regular file" <<<"$out" || fail "cache add of a FIFO: $out"

# Every transfer's --json names the way each file took.
"$hbmio" read "$work/explained.bin" --backend posix --json "$work/read.json" > /dev/null
python3 - "$work/read.json" "$work/explained.bin" <<'PY' || fail "read --json paths: $(cat "$work/read.json")"
import json, sys
(p,) = json.load(open(sys.argv[1]))["stats"]["paths"]
assert p == {"file": sys.argv[2], "path": "posix", "reason": "pread through the page cache", "bytes": 300000, "bytes_direct": 0}, p
PY
echo "doctor CLI: all passed"
