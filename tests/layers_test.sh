#!/usr/bin/env bash
# The layers of src/ and the only directions their includes may take. A newcomer sees the layers
# in the folders; this test keeps an include from crossing one the wrong way (the io layer once
# included the doctor's headers, and the doctor re-derived what auto picks).
#
#   core      errors, positional I/O, worker threads        -> nothing of hbmio's but its public headers
#   platform  sysfs/procfs under a settable root            -> core
#   memory    buffers, the CUDA runtime layer               -> core
#   shim      libcufile and NCCL, loaded at run time         -> core, memory
#   format    safetensors headers, strict JSON              -> core
#   io        the engines and auto's choice                 -> core, platform, memory, shim
#   checkpoint loads, saves, checksums, distributed loads   -> core, platform, memory, shim, format, io
#   doctor    the deployment checklist                      -> core, platform, memory, shim, io
# Public headers (include/hbmio) may be included from anywhere; they include no src/ header.
set -euo pipefail
cd "$(dirname "$0")/../src"
declare -A allowed=(
  [core]="core"
  [platform]="platform core"
  [memory]="memory core"
  [shim]="shim core memory"
  [format]="format core"
  [io]="io core platform memory shim"
  [checkpoint]="checkpoint core platform memory shim format io"
  [doctor]="doctor core platform memory shim io"
)
bad=0
for layer in */; do
  layer=${layer%/}
  if [ -z "${allowed[$layer]+x}" ]; then
    echo "src/$layer: a layer this test does not know; add it to the table with its allowed includes"
    bad=1
    continue
  fi
  while IFS=: read -r file line text; do
    target=$(sed -E 's/.*#include "([a-z_]+)\/.*/\1/' <<<"$text")
    [ "$target" = hbmio ] && continue
    if ! grep -qw "$target" <<<"${allowed[$layer]}"; then
      echo "src/$file:$line: the $layer layer includes $target ($text)"
      bad=1
    fi
  done < <(grep -rn '#include "[a-z_]*/' "$layer" | sed 's/^\([^:]*\):\([0-9]*\):/\1:\2:/')
done
if grep -rn '#include "\(core\|platform\|memory\|shim\|format\|io\|checkpoint\|doctor\)/' ../include; then
  echo "a public header includes a private one"
  bad=1
fi
[ $bad = 0 ] && echo "layers: every include goes the allowed way"
exit $bad
