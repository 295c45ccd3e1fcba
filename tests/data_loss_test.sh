#!/usr/bin/env bash
# Data-loss regression tests ("never lose or fabricate data") through the CLI, one per defect
# found (the sections run in another order: quick checks first):
#   1. Ctrl-C at many points of a sharded and of a single-file `ckpt generate` over an existing
#      checkpoint: the path verifies and holds, byte for byte, the old or the new checkpoint, no
#      temporary stays, and the message says which of the two the path holds.
#   2. `ckpt verify` and `ckpt load --verify` racing replacements of the file: never a false failure.
#   3. `ckpt checksum` of a file that shrinks while being read: an error naming the cause, not
#      SIGBUS, and no temporary left.
#   4. Saves refuse targets that are not regular files (a FIFO; a scratch character device node).
#   5. Commands that write generated data are named so (`ckpt generate`, `write-random`; the old
#      names say they were renamed) and never replace an existing file without --force.
# Usage: data_loss_test.sh PATH/TO/hbmio
set -euo pipefail
hbmio="$1"
dir=$(mktemp -d "${HBMIO_TEST_DIR:-/var/tmp}/hbmio-loss-XXXXXX")
bg=""  # the background process of the moment, ended on the way out
cleanup() {
  if [ -n "$bg" ]; then kill -9 "$bg" 2>/dev/null || true; wait "$bg" 2>/dev/null || true; fi
  rm -rf "$dir"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
started=$SECONDS
checks=0
pass() { checks=$((checks + 1)); }
gen() { "$hbmio" ckpt generate "$@"; }
write_random() { "$hbmio" write-random "$@"; }
sum_of() { sha256sum <"$1" | cut -d' ' -f1; }
# The checkpoint files of a sharded checkpoint directory, names and contents, as one digest
# (empty input, a digest of nothing, where the directory is missing or empty).
tree_sum() { (cd "$1" 2>/dev/null && sha256sum -- model-*.safetensors model.safetensors.index.json 2>/dev/null) | sha256sum | cut -d' ' -f1; }
all_sums() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum); }
no_temporaries() {  # DIR WHAT: nothing named *hbmio-tmp* directly in DIR
  local left
  left=$(ls -A "$1" | grep hbmio-tmp || true)
  [ -z "$left" ] || fail "$2: temporaries left in $1: $left"
}
shopt -s nullglob
# check_stopped RC ERRFILE STATE WHAT: after SIGINT, the exit status and the message agree with
# what the path holds (STATE: old or new).
check_stopped() {
  local rc=$1 err=$2 state=$3 what=$4
  case "$rc" in
    130)
      if [ "$state" = old ]; then
        grep -q "holds what it held before" "$err" || fail "$what: the path holds the old checkpoint, but the message does not say so: $(cat "$err")"
        ! grep -q "holds the new checkpoint" "$err" || fail "$what: the path holds the old checkpoint, but the message says new: $(cat "$err")"
      else
        grep -q "holds the new checkpoint" "$err" || fail "$what: the path holds the new checkpoint, but the message does not say so: $(cat "$err")"
        ! grep -q "holds what it held before" "$err" || fail "$what: the path holds the new checkpoint, but the message says it holds the old one: $(cat "$err")"
      fi ;;
    0) [ "$state" = new ] || fail "$what: exit 0 (finished before the signal), but the path holds the old checkpoint" ;;
    *) fail "$what: exit status $rc, not 130 (SIGINT) or 0 (finished first): $(cat "$err")" ;;
  esac
}

# --- 5. Generated data: named so, and no overwrite without --force ---------------------------
rc=0; out=$("$hbmio" ckpt save "$dir/old-name.safetensors" --count 1 --tensor-size 4KiB 2>&1) || rc=$?
[ "$rc" = 1 ] || fail "'ckpt save' (renamed to 'ckpt generate') exited $rc, not 1: $out"
grep -q renamed <<<"$out" || fail "'ckpt save' does not say it was renamed: $out"
[ ! -e "$dir/old-name.safetensors" ] || fail "'ckpt save' still wrote a file"
rc=0; out=$("$hbmio" write "$dir/old-name.bin" --size 4KiB 2>&1) || rc=$?
[ "$rc" = 1 ] || fail "'write' (renamed to 'write-random') exited $rc, not 1: $out"
grep -q renamed <<<"$out" || fail "'write' does not say it was renamed: $out"
[ ! -e "$dir/old-name.bin" ] || fail "'write' still wrote a file"
out=$("$hbmio" ckpt --help 2>&1) || true
grep -q generate <<<"$out" || fail "'ckpt --help' does not list generate: $out"
out=$("$hbmio" --help 2>&1) || true
grep -q write-random <<<"$out" || fail "'--help' does not list write-random: $out"
pass

# A new name needs no --force.
gen "$dir/victim.safetensors" --count 3 --tensor-size 64KiB --seed 7 >/dev/null || fail "generate to a new file"
write_random "$dir/victim.bin" --size 8KiB --seed 7 >/dev/null || fail "write-random to a new file"
[ "$(stat -c %s "$dir/victim.bin")" = 8192 ] || fail "write-random wrote $(stat -c %s "$dir/victim.bin") bytes, not 8192"
printf 'notes that are no checkpoint\n' >"$dir/notes.txt"
for victim in victim.safetensors victim.bin notes.txt; do
  before=$(sum_of "$dir/$victim")
  rc=0; out=$(gen "$dir/$victim" --count 2 --tensor-size 4KiB --seed 8 2>&1) || rc=$?
  [ "$rc" = 1 ] || fail "generate over the existing $victim without --force exited $rc, not 1: $out"
  grep -q -- --force <<<"$out" || fail "generate's refusal to replace $victim does not mention --force: $out"
  [ "$(sum_of "$dir/$victim")" = "$before" ] || fail "generate without --force changed $victim"
  rc=0; out=$(write_random "$dir/$victim" --size 4KiB --seed 8 2>&1) || rc=$?
  [ "$rc" = 1 ] || fail "write-random over the existing $victim without --force exited $rc, not 1: $out"
  grep -q -- --force <<<"$out" || fail "write-random's refusal to replace $victim does not mention --force: $out"
  [ "$(sum_of "$dir/$victim")" = "$before" ] || fail "write-random without --force changed $victim"
  no_temporaries "$dir" "refused overwrite of $victim"
done
pass
# A sharded checkpoint directory: refused as a whole, every file byte-identical afterwards.
gen "$dir/shd" --count 4 --tensor-size 4KiB --max-shard-size 8KiB --seed 1 >/dev/null || fail "sharded generate to a new directory"
before=$(all_sums "$dir/shd")
rc=0; out=$(gen "$dir/shd" --count 4 --tensor-size 4KiB --max-shard-size 4KiB --seed 2 2>&1) || rc=$?
[ "$rc" = 1 ] || fail "sharded generate over an existing checkpoint without --force exited $rc, not 1: $out"
grep -q -- --force <<<"$out" || fail "sharded generate's refusal does not mention --force: $out"
[ "$(all_sums "$dir/shd")" = "$before" ] || fail "sharded generate without --force changed the checkpoint"
no_temporaries "$dir" "refused sharded overwrite"
pass
# With --force they replace.
gen "$dir/victim.safetensors" --count 2 --tensor-size 4KiB --seed 8 --force >/dev/null || fail "generate --force"
"$hbmio" ckpt info "$dir/victim.safetensors" --json - | python3 -c "
import json,sys; assert json.load(sys.stdin)['tensor_count'] == 2" || fail "generate --force did not replace the file"
"$hbmio" ckpt verify "$dir/victim.safetensors" >/dev/null || fail "verify after generate --force"
write_random "$dir/victim.bin" --size 4KiB --seed 8 --force >/dev/null || fail "write-random --force"
[ "$(stat -c %s "$dir/victim.bin")" = 4096 ] || fail "write-random --force left $(stat -c %s "$dir/victim.bin") bytes, not 4096"
gen "$dir/shd" --count 4 --tensor-size 4KiB --max-shard-size 4KiB --seed 2 --force >/dev/null || fail "sharded generate --force"
[ "$(ls "$dir/shd" | grep -c 'of-00004.safetensors')" = 4 ] || fail "sharded generate --force: $(ls "$dir/shd")"
pass

# --- 4. Targets that are not regular files ----------------------------------------------------
# A FIFO and a character device node (c 1 3, the null device, made here in the scratch directory):
# generate --force and checksum refuse them, and leave them what they are. `timeout`: opening a
# FIFO for reading waits for a writer.
mkfifo "$dir/fifo"
special=("$dir/fifo")
if [ "$(id -u)" = 0 ] && mknod "$dir/node" c 1 3 2>/dev/null; then
  special+=("$dir/node")
else
  echo "note: not root or mknod refused: the device-node checks are skipped (the FIFO ones ran)"
fi
for target in "${special[@]}"; do
  name=${target##*/}
  rc=0; out=$(timeout 30 "$hbmio" ckpt generate "$target" --count 1 --tensor-size 1MiB --force 2>&1) || rc=$?
  [ "$rc" = 1 ] || fail "generate --force onto the $name exited $rc, not 1: $out"
  grep -q "not a regular file" <<<"$out" || fail "generate --force onto the $name: message does not say 'not a regular file': $out"
  rc=0; out=$(timeout 30 "$hbmio" ckpt generate "$target" --count 1 --tensor-size 1MiB 2>&1) || rc=$?
  [ "$rc" = 1 ] || fail "generate onto the $name (no --force) exited $rc, not 1: $out"
  rc=0; out=$(timeout 30 "$hbmio" ckpt checksum "$target" 2>&1) || rc=$?
  [ "$rc" = 1 ] || fail "checksum of the $name exited $rc, not 1: $out"
  grep -q "not a regular file" <<<"$out" || fail "checksum of the $name: message does not say 'not a regular file': $out"
  if [ "$name" = fifo ]; then
    test -p "$target" || fail "the FIFO is no longer a FIFO: $(ls -l "$target")"
  else
    test -c "$target" || fail "the device node is no longer a character device: $(ls -l "$target")"
  fi
  no_temporaries "$dir" "refused save onto the $name"
  pass
done

# --- 1. Ctrl-C during a sharded generate ------------------------------------------------------
# A shard per 4 KiB tensor: the save spends its time creating shards (each fsynced) in the
# temporary directory, then swaps it with the old checkpoint (renameat2 RENAME_EXCHANGE) and
# deletes the old one, which is then under the temporary name. SIGINT lands at different counts of
# entries in the temporary directory, on the way up (building the new one) and on the way down
# (deleting the old one), and after the temporary is gone. (The defect was found with 600
# shards; a save of 600 fsynced shards takes over 10 s on a small VM, so fewer keep the test short.)
shards=120
many=(--count $shards --tensor-size 4KiB --max-shard-size 4KiB)
mkdir "$dir/ref1" "$dir/ref2"
gen "$dir/ref1/many" "${many[@]}" --seed 1 >/dev/null || fail "reference sharded generate, seed 1"
gen "$dir/ref2/many" "${many[@]}" --seed 2 >/dev/null || fail "reference sharded generate, seed 2"
many1=$(tree_sum "$dir/ref1/many"); many2=$(tree_sum "$dir/ref2/many")
[ "$many1" != "$many2" ] || fail "seeds 1 and 2 generated the same sharded checkpoint"
gen "$dir/many" "${many[@]}" --seed 1 >/dev/null || fail "sharded generate, seed 1"
[ "$(tree_sum "$dir/many")" = "$many1" ] || fail "sharded generate is not deterministic per seed: cannot tell old from new"
sharded_old=0; sharded_new=0

sharded_trial() {  # TRIGGER: N (entries in the temporary directory, on the way up), down:N
                   # (on the way down, after the swap), or gone (the temporary was seen and is gone)
  local trigger=$1 rc=0 seen=no peak=0 n=0 t0=$SECONDS tmp=() entries=() state=neither what="sharded SIGINT at $1"
  # The binary itself in the background (a shell function would run in a subshell, whose pid
  # would get the signal).
  "$hbmio" ckpt generate "$dir/many" "${many[@]}" --seed 2 --force >/dev/null 2>"$dir/int.err" &
  bg=$!
  while kill -0 "$bg" 2>/dev/null; do
    tmp=("$dir"/.many.hbmio-tmp-*)
    if ((${#tmp[@]})); then
      seen=yes
      entries=("${tmp[0]}"/*)
      n=${#entries[@]}
      ((n > peak)) && peak=$n
    elif [ $seen = yes ]; then
      break  # the temporary is gone: every trigger fires now at the latest
    fi
    if [ $seen = yes ]; then
      case $trigger in
        gone) ;;
        down:*) ((peak >= shards && n <= ${trigger#down:})) && break ;;
        *) ((n >= trigger)) && break ;;
      esac
    fi
    ((SECONDS - t0 < 60)) || fail "$what: the generate ran for over 60 s"
  done
  kill -INT "$bg" 2>/dev/null || true
  wait "$bg" || rc=$?
  bg=""
  no_temporaries "$dir" "$what"
  no_temporaries "$dir/many" "$what"
  "$hbmio" ckpt verify "$dir/many" >"$dir/verify.out" 2>&1 || fail "$what (exit $rc): the checkpoint does not verify: $(cat "$dir/verify.out"); stop message: $(cat "$dir/int.err")"
  case "$(tree_sum "$dir/many")" in
    "$many1") state=old; sharded_old=$((sharded_old + 1)) ;;
    "$many2") state=new; sharded_new=$((sharded_new + 1)) ;;
    *) fail "$what (exit $rc): the path holds neither the old nor the new checkpoint: $(ls -A "$dir/many" | wc -l) entries; $(cat "$dir/int.err")" ;;
  esac
  check_stopped "$rc" "$dir/int.err" "$state" "$what"
  if [ "$state" != old ]; then  # back to the old one for the next trial
    gen "$dir/many" "${many[@]}" --seed 1 --force >/dev/null || fail "restoring the seed-1 checkpoint"
    [ "$(tree_sum "$dir/many")" = "$many1" ] || fail "restoring the seed-1 checkpoint gave other bytes"
  fi
  pass
}
for trigger in 1 10 60 $((shards - 10)) $((shards - 1)) $shards $((shards + 1)) down:$((shards * 3 / 4)) down:$((shards / 4)) gone; do
  sharded_trial "$trigger"
done

# --- 1b. Ctrl-C during a single-file generate -------------------------------------------------
one=(--count 8 --tensor-size 8MiB)
rm -rf "$dir/ref1" "$dir/ref2"
mkdir "$dir/ref1" "$dir/ref2"
gen "$dir/ref1/one.safetensors" "${one[@]}" --seed 1 >/dev/null || fail "reference generate, seed 1"
gen "$dir/ref2/one.safetensors" "${one[@]}" --seed 2 >/dev/null || fail "reference generate, seed 2"
one1=$(sum_of "$dir/ref1/one.safetensors"); one2=$(sum_of "$dir/ref2/one.safetensors")
rm -rf "$dir/ref1" "$dir/ref2"
[ "$one1" != "$one2" ] || fail "seeds 1 and 2 generated the same file"
gen "$dir/one.safetensors" "${one[@]}" --seed 1 >/dev/null || fail "generate, seed 1"
[ "$(sum_of "$dir/one.safetensors")" = "$one1" ] || fail "generate is not deterministic per seed: cannot tell old from new"
file_old=0; file_new=0
file_trial() {  # TRIGGER: sleep:S (S seconds after the start), tmp+S (S seconds after the temporary
                # appeared), or gone (the temporary was seen and is gone)
  local trigger=$1 rc=0 seen=no t0=$SECONDS tmp=() state=neither what="single-file SIGINT at $1"
  "$hbmio" ckpt generate "$dir/one.safetensors" "${one[@]}" --seed 2 --force >/dev/null 2>"$dir/int.err" &
  bg=$!
  case $trigger in
    sleep:*) sleep "${trigger#sleep:}" ;;
    *)
      while kill -0 "$bg" 2>/dev/null; do
        tmp=("$dir"/.one.safetensors.hbmio-tmp-*)
        if ((${#tmp[@]})); then
          seen=yes
          [ "$trigger" != gone ] && { sleep "${trigger#tmp+}"; break; }
        elif [ $seen = yes ]; then
          break
        fi
        ((SECONDS - t0 < 60)) || fail "$what: the generate ran for over 60 s"
      done ;;
  esac
  kill -INT "$bg" 2>/dev/null || true
  wait "$bg" || rc=$?
  bg=""
  no_temporaries "$dir" "$what"
  "$hbmio" ckpt verify "$dir/one.safetensors" >"$dir/verify.out" 2>&1 || fail "$what (exit $rc): the file does not verify: $(cat "$dir/verify.out"); stop message: $(cat "$dir/int.err")"
  case "$(sum_of "$dir/one.safetensors")" in
    "$one1") state=old; file_old=$((file_old + 1)) ;;
    "$one2") state=new; file_new=$((file_new + 1)) ;;
    *) fail "$what (exit $rc): the file is neither the old nor the new one; $(cat "$dir/int.err")" ;;
  esac
  check_stopped "$rc" "$dir/int.err" "$state" "$what"
  if [ "$state" != old ]; then
    gen "$dir/one.safetensors" "${one[@]}" --seed 1 --force >/dev/null || fail "restoring the seed-1 file"
  fi
  pass
}
# "gone" four times: between the rename and the end of the process the window is short.
for trigger in sleep:0.05 tmp+0 tmp+0.02 tmp+0.05 tmp+0.1 tmp+0.2 gone gone gone gone; do file_trial "$trigger"; done
rm -f "$dir/one.safetensors"

# --- 3. checksum of a file that shrinks while being read --------------------------------------
# 512 MiB without checksums; `ckpt checksum` reads it to compute them and writes a new file (at
# most 1 GiB on disk together); the file is cut to 100 MiB under it.
hits=0
for delay in 0.05 0.15 0.3 0.6; do
  gen "$dir/m.safetensors" --count 8 --tensor-size 64MiB --no-checksums --force >/dev/null || fail "generate m.safetensors"
  rc=0
  "$hbmio" ckpt checksum "$dir/m.safetensors" >/dev/null 2>"$dir/ck.err" &
  bg=$!
  sleep "$delay"
  truncate -s 100MiB "$dir/m.safetensors"
  wait "$bg" || rc=$?
  bg=""
  what="checksum, file cut to 100 MiB after ${delay} s"
  no_temporaries "$dir" "$what"
  case "$rc" in
    0) echo "note: $what: the checksum finished before the cut" ;;
    1)
      [ "$(stat -c %s "$dir/m.safetensors")" = 104857600 ] || fail "$what: the failed checksum replaced the file"
      if grep -q "changed while being read" "$dir/ck.err"; then
        hits=$((hits + 1))
      else
        # Cut before the checksum opened the file (a slow start, e.g. under the sanitizers): the
        # header no longer fits the file, which is refused as such, cleanly.
        grep -q "data buffer past end of file" "$dir/ck.err" ||
          fail "$what: the message says neither 'changed while being read' nor that the header does not fit the file: $(cat "$dir/ck.err")"
        echo "note: $what: the file was cut before the checksum opened it"
      fi ;;
    *) fail "$what: exit status $rc (135 is SIGBUS), not 1: $(cat "$dir/ck.err")" ;;
  esac
  pass
done
rm -f "$dir/m.safetensors"
[ "$hits" -ge 1 ] || fail "the truncation never happened while the checksum ran (4 trials): the test did not test"

# --- 2. verify and load --verify racing replacements ------------------------------------------
# Two checkpoints of the same tensor names and sizes, different data and dtypes (headers of
# different lengths), published in turn at one path by a background loop.
r1=(--count 4 --tensor-size 1MiB --seed 1 --dtype BF16)
r2=(--count 4 --tensor-size 1MiB --seed 2 --dtype F8_E4M3FNUZ)
header_length() { od -An -tu8 -N8 "$1" | tr -d ' '; }
gen "$dir/r.safetensors" "${r2[@]}" >/dev/null || fail "generate r.safetensors (2)"
h2=$(header_length "$dir/r.safetensors")
gen "$dir/r.safetensors" "${r1[@]}" --force >/dev/null || fail "generate r.safetensors (1)"
h1=$(header_length "$dir/r.safetensors")
[ "$h1" != "$h2" ] || fail "test set-up: the two versions have headers of the same length ($h1 bytes)"
(
  i=0
  while [ ! -e "$dir/stop" ]; do
    gen "$dir/r.safetensors" "${r2[@]}" --force >/dev/null || exit 1
    gen "$dir/r.safetensors" "${r1[@]}" --force >/dev/null || exit 1
    i=$((i + 2))
  done
  echo "$i" >"$dir/published"
) 2>"$dir/writer.err" &
bg=$!
race_fail() {
  touch "$dir/stop"; wait "$bg" || true; bg=""
  fail "$@"
}
t0=$SECONDS
for i in $(seq 100); do
  "$hbmio" ckpt verify "$dir/r.safetensors" >/dev/null 2>"$dir/v.err" ||
    race_fail "verify $i of 100 failed while the file was being replaced (every published file is valid): $(cat "$dir/v.err")"
  kill -0 "$bg" 2>/dev/null || race_fail "the writer stopped: $(cat "$dir/writer.err")"
  ((SECONDS - t0 < 60)) || race_fail "100 verifies took over 60 s"
done
for i in $(seq 100); do
  "$hbmio" ckpt load "$dir/r.safetensors" --into host --verify >/dev/null 2>"$dir/v.err" ||
    race_fail "load --verify $i of 100 failed while the file was being replaced (every published file is valid): $(cat "$dir/v.err")"
  kill -0 "$bg" 2>/dev/null || race_fail "the writer stopped: $(cat "$dir/writer.err")"
  ((SECONDS - t0 < 90)) || race_fail "100 loads took over 30 s"
done
touch "$dir/stop"
rc=0; wait "$bg" || rc=$?
bg=""
[ "$rc" = 0 ] || fail "the writer failed (exit $rc): $(cat "$dir/writer.err")"
published=$(cat "$dir/published")
[ "$published" -ge 4 ] || fail "the writer published only $published files while 200 commands ran: the race was not exercised"
"$hbmio" ckpt verify "$dir/r.safetensors" >/dev/null || fail "the last published file does not verify"
pass

echo "data loss: all $checks checks passed in $((SECONDS - started)) s (Ctrl-C: sharded $sharded_old old / $sharded_new new, single file $file_old old / $file_new new; checksum cut mid-read $hits/4; $published replacements under 200 verifies)"
