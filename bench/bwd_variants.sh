#!/usr/bin/env bash
# On a GPU machine: builds bench/bwd_check.cu with several tuning-knob settings (in parallel), checks
# each against the reference on a few shapes and times it on the main shape.
#   bash bench/bwd_variants.sh "-DSSB_PIECE_STEPS=2" "..."
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
i=0
for flags in "" "$@"; do
  nvcc -O3 -arch=sm_90 -std=c++17 $flags -o "/tmp/bwd_v$i" bench/bwd_check.cu &
  i=$((i + 1))
done
wait
i=0
for flags in "" "$@"; do
  echo "== variant $i: ${flags:-(defaults)}"
  for a in "2 130 77 16 1 bld f32 64 1 1 1 1 1 1" "3 96 45 5 2 bld f32 32 1 0 1 0 1 0" "2 256 300 16 2 bld bf16 32 1 1 1 1 1 1" \
           "1 20 50 200 1 bdl f32 32 1 1 1 1 1 1" "1 24 70 64 2 bld f32 64 1 1 1 1 1 1" "1 9 40 256 0 bdl f32 32 1 1 1 1 1 1"; do
    "/tmp/bwd_v$i" check $a | tail -n 1
  done
  for a in "8 4096 2048 16 1 bdl bf16 32 1 1 1 1 0 0" "8 4096 2048 16 1 bld bf16 32 1 1 1 1 0 0" "8 4096 2048 16 1 bdl bf16 64 1 1 1 1 0 0"; do
    "/tmp/bwd_v$i" time $a
  done
  i=$((i + 1))
done
