#!/usr/bin/env bash
# Builds the libFuzzer targets with clang under ASan + UBSan into ${1:-build-fuzz}/ (see README.md).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$repo/build-fuzz}"
cxx="${CXX_FUZZ:-clang++-14}"
mkdir -p "$out"
flags=(-std=c++20 -g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
       -DFMT_HEADER_ONLY -I"$repo/include" -I"$repo/src" -I"$repo/fuzz")
library=("$repo/src/format/safetensors.cpp" "$repo/src/format/strict_json.cpp" "$repo/src/core/error.cpp")
for target in safetensors_header_fuzzer index_fuzzer; do
  "$cxx" "${flags[@]}" "$repo/fuzz/$target.cpp" "${library[@]}" -o "$out/$target" &
done
wait
echo "built: $out/safetensors_header_fuzzer $out/index_fuzzer"
