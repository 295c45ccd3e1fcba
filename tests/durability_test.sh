#!/usr/bin/env bash
# A save is durable only if its system calls come in the right order: the data of every new file
# fsynced before the rename that publishes it, the directory fsynced after the rename (else the
# new name can vanish in a crash). Tests that kill or fail a save cannot see a missing fsync, so
# this one watches the calls themselves with strace: a single file, a new sharded checkpoint
# (rename of the directory) and a replaced one (renameat2 RENAME_EXCHANGE). Then it kills the
# saver with SIGKILL at each of those steps (strace -e inject: the signal arrives as the call is
# entered, so the step does not happen) and at data writes: the name must hold, byte for byte,
# the complete old or the complete new checkpoint, and the next save must clean up.
set -euo pipefail
hbmio="$1"
command -v strace >/dev/null || { echo "SKIP: strace is not installed (scripts/install-deps.sh installs it)"; exit 0; }
strace -qq -o /dev/null true 2>/dev/null || { echo "SKIP: strace cannot trace here (ptrace refused, e.g. by a container's seccomp profile)"; exit 0; }
# LeakSanitizer stops the process's threads with ptrace at exit, which strace already holds: under
# the sanitizer build its leak check would fail every traced run. Leaks are checked by the same
# commands in ckpt_cli_test.sh, untraced.
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
dir=$(mktemp -d "${HBMIO_TEST_DIR:-/var/tmp}/hbmio-durable-XXXXXX")
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# -y prints each descriptor's path, so "fsync(3</dir/.x.hbmio-tmp-...>)" names what was synced.
traced() {
  local log=$1; shift
  strace -f -y -qq -e trace=fsync,fdatasync,rename,renameat,renameat2,linkat -o "$log" "$@" >/dev/null ||
    fail "strace $* (is ptrace allowed here?)"
}

# check LOG PUBLISHED PARENT: every file written under the temporary name(s) is fsynced before
# the rename that publishes PUBLISHED, and PARENT is fsynced after it.
check() {
  python3 - "$@" <<'PY' || exit 1
import re, sys
log, published, parent = sys.argv[1:4]
calls = []
for line in open(log):
    m = re.match(r"\s*\d+\s+(\w+)\((.*)\)\s+=\s+(-?\d+)", line)
    if m:
        calls.append((m.group(1), m.group(2), int(m.group(3))))
def fail(why):
    print(f"FAIL: {why}\n" + "".join(open(log).readlines()[-40:]), file=sys.stderr)
    sys.exit(1)
if any(r != 0 for _, _, r in calls):
    fail("a traced call failed")
renames = [i for i, (name, args, _) in enumerate(calls)
           if name.startswith("rename") and re.search(r'"%s"' % re.escape(published), args.split(",", 2)[-1] if name == "rename" else args)]
if not renames:
    fail(f"no rename onto {published}")
publish = renames[-1]
# The temporary name the rename published: its first path argument.
temp = re.findall(r'"([^"]+)"', calls[publish][1])[0]
synced_before = [re.search(r"<([^>]+)>", args).group(1) for name, args, _ in calls[:publish] if name in ("fsync", "fdatasync")]
synced_after = [re.search(r"<([^>]+)>", args).group(1) for name, args, _ in calls[publish + 1:] if name in ("fsync", "fdatasync")]
# A file written unnamed (O_TMPFILE) is fsynced by descriptor ("fsync(5</dir/#123 (deleted)>)")
# and then given a name by linkat(AT_FDCWD, "/proc/self/fd/5", ..., NAME) or linkat(5, "", ...):
# such a NAME counts as synced when its descriptor was fsynced before the link.
for i, (name, args, _) in enumerate(calls[:publish]):
    if name != "linkat":
        continue
    paths = re.findall(r'"([^"]*)"', args)
    fd = re.match(r"/proc/self/fd/(\d+)$", paths[0]) if paths else None
    fd = fd.group(1) if fd else re.match(r"\s*(\d+)", args).group(1) if re.match(r"\s*\d+", args) else None
    if fd and any(n in ("fsync", "fdatasync") and re.match(r"\s*%s<" % fd, a) for n, a, _ in calls[:i]):
        synced_before.append(paths[-1])
# The published thing itself (a file), or every file and the directory itself (a sharded
# checkpoint built under the temporary directory name), must be synced before the rename.
if temp not in synced_before:
    fail(f"{temp} was not fsynced before the rename publishing it")
# Files inside a temporary directory: fsynced under their own name, or (a shard, itself saved
# crash-safely) under their temporary name and renamed to their name, all before the publish.
for name in sys.argv[4:]:
    final = f"{temp}/{name}"
    if final in synced_before:
        continue
    renamed_from = [re.findall(r'"([^"]+)"', args)[0] for n, args, _ in calls[:publish]
                    if n.startswith("rename") and args.rstrip().endswith(f'"{final}"')]
    if not renamed_from or renamed_from[-1] not in synced_before:
        fail(f"{final} was not fsynced before the rename publishing {published}")
if parent not in synced_after:
    fail(f"the directory {parent} was not fsynced after the rename")
print(f"ok: {len(synced_before)} fsync(s) before publishing {published}, {parent} fsynced after")
PY
}

# A single file.
traced "$dir/one.log" "$hbmio" ckpt generate "$dir/m.safetensors" --force --count 4 --tensor-size 1MiB
check "$dir/one.log" "$dir/m.safetensors" "$dir"
# The same name again: replaced, the same order.
traced "$dir/again.log" "$hbmio" ckpt generate "$dir/m.safetensors" --force --count 2 --tensor-size 1MiB --seed 9
check "$dir/again.log" "$dir/m.safetensors" "$dir"

# A new sharded checkpoint (3 shards + index): every shard and the index synced inside the
# temporary directory, the directory synced, then renamed into place, then its parent synced.
shards=(model-00001-of-00003.safetensors model-00002-of-00003.safetensors model-00003-of-00003.safetensors
        model.safetensors.index.json)
traced "$dir/sharded.log" "$hbmio" ckpt generate "$dir/ckpt" --force --count 6 --tensor-size 1MiB --max-shard-size 2MiB
check "$dir/sharded.log" "$dir/ckpt" "$dir" "${shards[@]}"
# Replacing it swaps the directories with renameat2(RENAME_EXCHANGE): the same order.
traced "$dir/swap.log" "$hbmio" ckpt generate "$dir/ckpt" --force --count 6 --tensor-size 1MiB --max-shard-size 2MiB --seed 5
grep -q "RENAME_EXCHANGE" "$dir/swap.log" || fail "a replaced sharded checkpoint is not swapped in with RENAME_EXCHANGE"
check "$dir/swap.log" "$dir/ckpt" "$dir" "${shards[@]}"
"$hbmio" ckpt verify "$dir/ckpt" >/dev/null || fail "the swapped-in checkpoint does not verify"
echo "durability: all saves sync before they publish and sync the directory after"

# The bytes of a checkpoint: one file, or every file of a directory (names and contents).
digest() { if [ -d "$1" ]; then (cd "$1" && find . -type f | sort | xargs sha256sum) | sha256sum; else sha256sum <"$1"; fi; }

# kill_at LABEL TARGET SYSCALL WHEN SAVE-ARGS...: SIGKILL at the WHEN-th call of SYSCALL of a save
# of seed 2 over the seed-1 checkpoint at TARGET; the name must then hold seed 1 or seed 2 whole.
killed=0
kill_at() {
  local label=$1 target=$2 call=$3 when=$4; shift 4
  rm -rf "$target" "$dir/new"
  "$hbmio" ckpt generate "$dir/new" --force "$@" --seed 2 >/dev/null  # what a finished save writes
  local new_digest; new_digest=$(digest "$dir/new")
  "$hbmio" ckpt generate "$target" --force "$@" --seed 1 >/dev/null
  local old_digest; old_digest=$(digest "$target")
  strace -f -qq -o "$dir/kill.log" -e trace="$call" -e inject="$call":signal=KILL:when="$when" \
    "$hbmio" ckpt generate "$target" --force "$@" --seed 2 >/dev/null 2>&1 &
  wait $! 2>/dev/null || true  # its status is the kill; bash's "Killed" notice goes to wait's stderr
  if grep -q "killed by SIGKILL" "$dir/kill.log"; then
    killed=$((killed + 1))
  else
    fail "$label: the save made fewer than $when $call calls: no kill there (adjust the test)"
  fi
  local now; now=$(digest "$target")
  [ "$now" = "$old_digest" ] || [ "$now" = "$new_digest" ] ||
    fail "$label: killed at $call #$when, $target holds neither the old nor the new checkpoint"
  "$hbmio" ckpt verify "$target" >/dev/null || fail "$label: killed at $call #$when, the checkpoint does not verify"
  "$hbmio" ckpt generate "$target" --force "$@" --seed 3 >/dev/null || fail "$label: the save after the kill failed"
  [ -z "$(ls -A "$(dirname "$target")" | grep hbmio-tmp || true)" ] || fail "$label: temporaries left after the next save"
  echo "ok: $label, killed at $call #$when: $([ "$now" = "$old_digest" ] && echo old || echo new) checkpoint whole"
}
one=(--count 4 --tensor-size 1MiB)
kill_at "file, during the data writes" "$dir/k.safetensors" io_uring_enter 2 "${one[@]}"
kill_at "file, before its fsync" "$dir/k.safetensors" fsync 1 "${one[@]}"
kill_at "file, before the rename" "$dir/k.safetensors" rename 1 "${one[@]}"
kill_at "file, before the directory's fsync" "$dir/k.safetensors" fsync 2 "${one[@]}"
many=(--count 6 --tensor-size 1MiB --max-shard-size 2MiB)  # 3 shards + index
kill_at "sharded, during a shard's writes" "$dir/kdir" io_uring_enter 3 "${many[@]}"
kill_at "sharded, before the second shard's fsync" "$dir/kdir" fsync 3 "${many[@]}"
kill_at "sharded, before the third shard's rename" "$dir/kdir" rename 3 "${many[@]}"
kill_at "sharded, before the index's fsync" "$dir/kdir" fsync 7 "${many[@]}"
kill_at "sharded, before the directory's fsync" "$dir/kdir" fsync 8 "${many[@]}"
kill_at "sharded, before the swap" "$dir/kdir" renameat2 1 "${many[@]}"
kill_at "sharded, before the parent's fsync" "$dir/kdir" fsync 9 "${many[@]}"
echo "durability: $killed kills, each left a whole old or new checkpoint"
