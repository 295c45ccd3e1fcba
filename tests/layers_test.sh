#!/usr/bin/env bash
# The layers of src/ and the only directions their includes may take. A newcomer sees the layers
# in the folders; the build enforces the directions (cmake/layers.cmake: each layer compiles with
# only its allowed layers on its include path). This test reads the table the build used
# (layers.txt, written by cmake/layers.cmake at configure time: "<layer> <layers it may include>"
# per line) to check what a compiler never sees:
#   - every folder of src/ is a layer of the table (a new folder cannot be missed);
#   - every include of src/, headers no source includes among them, goes an allowed way;
#   - the public headers and the faces (the command, the Python binding, the examples and the
#     benchmark programs) include no private header: they use the library's public API only.
#
# Usage: layers_test.sh <build dir>/layers.txt
set -euo pipefail
table=${1:?usage: layers_test.sh <build dir>/layers.txt}
[ -r "$table" ] || { echo "$table: no layer table (configure the build first)"; exit 1; }
table=$(cd "$(dirname "$table")" && pwd)/$(basename "$table")
cd "$(dirname "$0")/.."

declare -A allowed=()
while read -r name sees; do
  [ -n "$name" ] && allowed[$name]="$name $sees"
done < "$table"
if [ ${#allowed[@]} = 0 ]; then
  echo "$table: no layers in the table"
  exit 1
fi
layers=$(printf '%s\n' "${!allowed[@]}" | sort | paste -sd'|')

bad=0
for dir in src/*/; do
  layer=$(basename "$dir")
  if [ -z "${allowed[$layer]+x}" ]; then
    echo "src/$layer: a folder of src/ that is no layer (add hbmio_layer($layer ...) to CMakeLists.txt)"
    bad=1
  fi
done
for layer in "${!allowed[@]}"; do
  [ -d "src/$layer" ] || { echo "layer $layer: no folder src/$layer"; bad=1; }
done

# Includes of the form "<folder>/...": another layer (or the public "hbmio/...").
while IFS=: read -r file line text; do
  layer=$(cut -d/ -f2 <<<"$file")
  target=$(sed -E 's/.*#include "([A-Za-z0-9_]+)\/.*/\1/' <<<"$text")
  [ "$target" = hbmio ] && continue
  [ -n "${allowed[$layer]+x}" ] || continue  # reported above
  if ! grep -qw -- "$target" <<<"${allowed[$layer]}"; then
    echo "$file:$line: the $layer layer includes $target ($text)"
    bad=1
  fi
done < <(grep -rnE '#include "[A-Za-z0-9_]+/' src || true)

# The public headers and the faces see only include/hbmio.
faces=(include tools python/src examples bench/micro)
for dir in "${faces[@]}"; do
  [ -d "$dir" ] || continue
  if grep -rnE "#include [\"<]($layers)/" "$dir"; then
    echo "$dir: includes a private header of src/ (above); use or extend the public API in include/hbmio"
    bad=1
  fi
done

[ $bad = 0 ] && echo "layers: ${#allowed[@]} layers, every folder of src/ among them, every include the allowed way"
exit $bad
