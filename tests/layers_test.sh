#!/usr/bin/env bash
# The layers of src/ and the only directions their includes may take. A newcomer sees the layers
# in the folders; the build enforces the directions (cmake/layers.cmake: each layer compiles with
# only its allowed layers on its include path), and this test reads the same table from
# CMakeLists.txt to check what a compiler never sees: headers no source includes, and the public
# headers, which must include no src/ header.
#
#   core      errors, positional I/O, worker threads        -> nothing of hbmio's but its public headers
#   platform  sysfs/procfs under a settable root            -> core
#   memory    buffers, the CUDA runtime layer               -> core
#   shim      libcufile and NCCL, loaded at run time         -> core, memory
#   format    safetensors headers, strict JSON              -> core
#   io        the engines and auto's choice                 -> core, platform, memory, shim
#   checkpoint loads, saves, checksums, distributed loads   -> core, platform, memory, shim, format, io
#   doctor    the deployment checklist                      -> core, platform, memory, shim, io
set -euo pipefail
cd "$(dirname "$0")/../src"
# hbmio_layer(<name> [SEES <layers>] SOURCES ...), possibly over several lines.
declare -A allowed=()
while read -r name sees; do
  allowed[$name]="$name $sees"
done < <(tr '\n' ' ' < ../CMakeLists.txt | grep -o 'hbmio_layer([a-z_]*\( SEES [a-z_ ]*\)\? *SOURCES' |
         sed -E 's/hbmio_layer\(([a-z_]*)( SEES ([a-z_ ]*))? *SOURCES/\1 \3/')
if [ ${#allowed[@]} -lt 8 ]; then
  echo "found ${#allowed[@]} hbmio_layer() calls in CMakeLists.txt; expected one per folder of src/"
  exit 1
fi
bad=0
for layer in */; do
  layer=${layer%/}
  if [ -z "${allowed[$layer]+x}" ]; then
    echo "src/$layer: a folder with no hbmio_layer() in CMakeLists.txt"
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
