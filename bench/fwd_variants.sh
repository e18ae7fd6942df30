#!/usr/bin/env bash
# On a GPU machine with nvcc: build bench/fwd_variants.cu once per knob setting and time each on the
# issue's main shape in both layouts, at each dstate of SSF_DSTATES (default 16; up to 256).
# Usage: [SSF_DSTATES="16 32 64"] bash bench/fwd_variants.sh ["-DSSF_POLY_STATES=0" ...]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}/fwd_variants"
mkdir -p "$out"
variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=("-DSSF_POLY_STATES=4")
i=0
for v in "${variants[@]}"; do
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a $v -o "$out/v$i" bench/fwd_variants.cu &
  i=$((i + 1))
done
wait
i=0
for v in "${variants[@]}"; do
  for n in ${SSF_DSTATES:-16}; do
    for layout in bdl bld; do "$out/v$i" 8 4096 2048 "$n" $layout; done
  done
  i=$((i + 1))
done
