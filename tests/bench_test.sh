#!/usr/bin/env bash
# End-to-end checks of `hbmio bench`: argument errors, a tiny run through every backend, the JSON
# schema, the SVG chart, rows with reasons for backends that cannot run. No timing thresholds:
# figures only have to exist and be positive.
set -euo pipefail
hbmio="$1"
dir=$(mktemp -d "${HBMIO_TEST_DIR:-/var/tmp}/hbmio-bench-test-XXXXXX")
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$hbmio" bench --help | grep -q -- '--backends' || fail "bench --help"
for flag in --file --size --dir --backends --into --write --cold --warm --both --runs --json --chart --queue-depth; do
  "$hbmio" bench --help | grep -q -- "$flag" || fail "bench --help does not explain $flag"
done

# Bad arguments: exit status 1 and a message naming the cause.
expect_error() {  # expect_error PATTERN ARGS...
  local pattern="$1" out status=0
  shift
  out=$("$hbmio" bench --dir "$dir" "$@" 2>&1) || status=$?
  [ "$status" = 1 ] || fail "bench $* exited $status, expected 1: $out"
  grep -q -- "$pattern" <<<"$out" || fail "bench $* message lacks '$pattern': $out"
}
expect_error "is not a size" --size 12XB
expect_error "unknown backend 'warp'" --backends posix,warp --size 1MiB
expect_error "nothing.bin" --file "$dir/nothing.bin"
expect_error "No such file" --file "$dir/nothing.bin"
expect_error "at least 1 run" --runs 0 --size 1MiB
expect_error "exclude each other" --file "$dir/x" --size 1MiB
expect_error "host (or cpu), pinned, cuda (the first GPU) or cuda:N" --into disk --size 1MiB
expect_error "at most one" --cold --warm --size 1MiB
[ -z "$(ls "$dir")" ] || fail "failed runs left files behind: $(ls "$dir")"

# A tiny run through every backend, every mode, reads and writes.
"$hbmio" bench --size 64MiB --runs 2 --both --write --dir "$dir" --json "$dir/b.json" --chart "$dir/c.svg" \
  >"$dir/table.txt" 2>"$dir/stderr.txt" || fail "tiny run: $(cat "$dir/table.txt" "$dir/stderr.txt")"
ls "$dir" | grep -q hbmio-bench- && fail "the sample file's directory was not removed"
grep -q "below 5" "$dir/stderr.txt" || fail "no warning about --runs < 5"
for word in machine "file " posix uring cufile auto "ceiling: storage read" "ceiling: page-cache read"; do
  grep -q "$word" "$dir/table.txt" || fail "table lacks '$word': $(cat "$dir/table.txt")"
done
"$hbmio" backends --json "$dir/backends.json"

# The report respects its reader: no line past 120 columns; a row names its cause in a few words
# and points to a numbered note below the table, which gives the full text once.
long=$(awk 'length($0) > 120' "$dir/table.txt")
[ -z "$long" ] || fail "table lines over 120 columns: $long"
python3 - "$dir/table.txt" "$dir/b.json" <<'EOF2'
import json, re, sys
lines = open(sys.argv[1]).read().splitlines()
j = json.load(open(sys.argv[2]))
def fail(msg):
    sys.exit(f"FAIL: {msg}")
if "notes" not in lines: fail("the table has no notes section")
table, notes_part = lines[:lines.index("notes")], lines[lines.index("notes") + 1:]
notes, number = {}, None
for line in notes_part:  # "  [3] text", continued on lines indented under the text
    m = re.match(r"  \[(\d+)\] (.*)", line)
    if m:
        number = int(m.group(1))
        notes[number] = m.group(2)
    elif line.startswith("      ") and number is not None:
        notes[number] += " " + line.strip()
if sorted(notes) != list(range(1, len(notes) + 1)): fail(f"notes are not numbered 1..n: {sorted(notes)}")
cited = set()
for line in table:
    for group in re.findall(r"\[([\d,]+)\]$", line):
        cited |= {int(n) for n in group.split(",")}
if cited != set(notes): fail(f"rows cite notes {sorted(cited)}, the table lists {sorted(notes)}")
# Every full reason is in the notes, once, and in no row.
texts = list(notes.values())
for r in j["results"] + j["ceilings"]:
    if r["status"] == "ok": continue
    if texts.count(r["reason"]) != 1: fail(f"the reason of {r['name']} {r['op']} {r['mode']} is not one note: {r['reason']}")
    if any(r["reason"] in line for line in table): fail(f"a row repeats the reason of {r['name']}")
if not j["machine"]["gpu"]["present"]:
    for line in table:
        if line.startswith("  cufile ") and not re.search(r"unavailable: (no CUDA build, )?no GPU\b.*\[\d+\]$", line):
            fail(f"without a GPU the cufile row should say 'no GPU' and cite its note: {line}")
if any(re.match(r"  auto \(\w+\) .*auto picked", line) for line in table):
    fail("an auto row repeats in its notes the pick its label names")
print("bench table: ok")
EOF2

python3 - "$dir/b.json" "$dir/backends.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
available = {b["name"]: b["available"] for b in json.load(open(sys.argv[2]))["backends"]}

def fail(msg):
    sys.exit(f"FAIL: {msg}")

for key in ("schema_version", "hbmio_version", "date", "command_line", "machine", "file", "settings", "ceilings", "results"):
    if key not in j: fail(f"JSON lacks {key}")
if "bench" not in j["command_line"]: fail(f"command line: {j['command_line']}")
m = j["machine"]
if not (m["cpus"] > 0 and m["memory_bytes"] > 0 and m["cpu_model"] and m["kernel"]): fail(f"machine: {m}")
if not m["gpu"]["present"] and not m["gpu"]["reason"]: fail("no GPU and no reason")
f = j["file"]
if not (f["bytes"] == 64 << 20 and f["generated"] and f["file_system"] and f["device"]): fail(f"file: {f}")
if j["settings"]["runs"] != 2: fail(f"settings: {j['settings']}")

number_fields = ("median_seconds", "p99_seconds", "gib_per_second", "cpu_seconds_per_gib")
def check_row(row, what):
    for key in ("name", "op", "mode", "available", "status", "reason", "note", "runs") + number_fields:
        if key not in row: fail(f"{what} lacks {key}: {row}")
    if row["available"]:
        if row["status"] != "ok": fail(f"{what} {row['status']}: {row['reason']}")
        if len(row["runs"]) != 2: fail(f"{what} has {len(row['runs'])} runs")
        for key in number_fields:
            if not row[key] > 0: fail(f"{what}: {key} = {row[key]}")
        if not 0 <= row["direct_io_fraction"] <= 1: fail(f"{what}: direct_io_fraction")
        if row["op"] == "read" and row["mode"] == "cold" and row.get("cache_drop") not in ("drop_caches", "posix_fadvise(DONTNEED)"):
            fail(f"{what}: cache_drop {row.get('cache_drop')}")
    elif not row["reason"]:
        fail(f"{what} unavailable without a reason")

# Every backend has a row in every group; one that cannot run says why.
groups = [("read", "cold"), ("read", "warm"), ("write", "durable")]
for op, mode in groups:
    for name in ("posix", "uring", "cufile", "auto"):
        rows = [r for r in j["results"] if (r["name"], r["op"], r["mode"]) == (name, op, mode)]
        if len(rows) != 1: fail(f"{len(rows)} rows for {name} {op} {mode}")
        check_row(rows[0], f"{name} {op} {mode}")
        if not available[name] and rows[0]["available"]:
            fail(f"{name} is not available here (hbmio backends) but its {op} {mode} row ran")
        if available[name] and name != "cufile" and not rows[0]["available"]:
            fail(f"{name} {op} {mode} unavailable: {rows[0]['reason']}")
        if rows[0]["available"] and rows[0].get("verified") is False: fail(f"{name} {op} {mode}: wrong data")
# Each backend's reads and writes were compared with the file once, on their first row.
for name in ("posix", "uring", "auto"):
    for op in ("read", "write"):
        if available[name] and not any(r.get("verified") for r in j["results"] if (r["name"], r["op"]) == (name, op)):
            fail(f"{name} {op}: no verified row")

ceilings = {(c["name"], c["op"], c["mode"]): c for c in j["ceilings"]}
for name, op, mode in (("ceiling: storage read (O_DIRECT)", "read", "cold"), ("ceiling: page-cache read", "read", "warm"),
                       ("ceiling: storage write (O_DIRECT)", "write", "durable")):
    c = ceilings.get((name, op, mode))
    if c is None: fail(f"no {name} ceiling")
    check_row(c, name)
    if available["uring"] and not c["available"]: fail(f"{name}: {c['reason']}")
for r in j["results"]:
    if r["available"] and available["uring"]:
        b = r["bound"]
        if not (b and b["gib_per_second"] > 0 and b["fraction"] > 0): fail(f"{r['name']} {r['op']} {r['mode']}: bound {b}")
print("bench JSON: ok")
EOF

python3 - "$dir/c.svg" <<'EOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
if not root.tag.endswith("svg"): sys.exit(f"FAIL: root element {root.tag}")
text = " ".join("".join(t.itertext()) for t in root.iter() if t.tag.endswith("text"))
for word in ("posix", "uring", "cufile", "auto", "ceiling: storage read", "GiB/s", "CPU"):
    if word not in text: sys.exit(f"FAIL: the chart does not name {word}")
# Long texts are wrapped at spaces into lines that fit the 1000-pixel chart, not cut.
lines = ["".join(t.itertext()) for t in root.iter() if t.tag.endswith("text")]
if max(len(line) for line in lines) > 150: sys.exit(f"FAIL: a chart line of {max(len(l) for l in lines)} characters")
if any(line.endswith("...") for line in lines): sys.exit("FAIL: the chart cuts a text")
print("bench SVG: ok")
EOF

# --file: an existing file is read, not removed; --cold alone makes only cold rows.
head -c 5MiB /dev/urandom >"$dir/given.bin"
"$hbmio" bench --file "$dir/given.bin" --backends posix,uring --cold --runs 1 --json - 2>/dev/null | python3 -c "
import json, sys; j = json.load(sys.stdin)
assert {r['mode'] for r in j['results']} == {'cold'}, j['results']
assert [r['name'] for r in j['results']] == ['posix', 'uring'], j['results']
assert not j['file']['generated'] and j['file']['bytes'] == 5 << 20, j['file']" || fail "--file --cold --json -"
[ -f "$dir/given.bin" ] || fail "--file was removed"

# Ctrl-C while the sample file is being written or read: the run stops, the scratch directory
# goes too, and the process ends by the signal (128 + 2).
"$hbmio" bench --size 512MiB --runs 5 --dir "$dir" --backends posix >/dev/null 2>"$dir/stop.err" &
pid=$!
for _ in $(seq 50); do ls "$dir" | grep -q hbmio-bench- && break; sleep 0.1; done
ls "$dir" | grep -q hbmio-bench- || fail "no scratch directory appeared under --dir"
sleep 0.5
kill -INT $pid
rc=0
wait $pid 2>/dev/null || rc=$?
[ "$rc" = 130 ] || fail "Ctrl-C: exit status $rc, expected 130: $(cat "$dir/stop.err")"
grep -q "stopped by SIGINT" "$dir/stop.err" || fail "Ctrl-C: no message: $(cat "$dir/stop.err")"
ls "$dir" | grep -q hbmio-bench- && fail "Ctrl-C left the scratch directory: $(ls -R "$dir")"
echo "bench: all checks passed"
