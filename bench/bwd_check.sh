#!/usr/bin/env bash
# On a GPU machine: builds bench/bwd_check.cu and runs its correctness matrix and timings.
#   bash bench/bwd_check.sh [check|time|all]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mode="${1:-all}"
nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/bwd_check bench/bwd_check.cu "${@:2}" || exit 1
fails=0
run() { echo "== $*"; /tmp/bwd_check "$@" || fails=$((fails + 1)); }
if [ "$mode" != time ]; then
  #        batch dim seqlen dstate groups layout dtype ckl z D bias sp h0 dfin
  run check 2 64 64 16 1 bdl f32 32 1 1 1 1 1 1
  run check 2 130 77 16 1 bdl f32 32 1 1 1 1 1 1
  run check 2 130 77 16 1 bld f32 64 1 1 1 1 1 1
  run check 1 96 200 16 4 bdl f32 96 0 1 0 1 0 1
  run check 3 96 45 5 2 bld f32 32 1 0 1 0 1 0
  run check 2 70 100 16 0 bdl f32 64 1 1 1 1 1 1
  run check 2 70 100 13 0 bld f32 32 0 0 0 1 1 1
  run check 1 40 90 32 1 bdl f32 32 1 1 1 1 1 1
  run check 1 24 70 64 2 bld f32 64 1 1 1 1 1 1
  run check 1 20 50 200 1 bdl f32 32 1 1 1 1 1 1
  run check 1 9 40 256 0 bdl f32 32 1 1 1 1 1 1
  run check 2 256 300 16 1 bdl bf16 64 1 1 1 1 1 1
  run check 2 256 300 16 2 bld bf16 32 1 1 1 1 1 1
  run check 1 64 20 16 1 bdl f32 32 1 1 1 1 1 1
  # 16-byte vector staging (seqlen, or the group's channels, a multiple of a vector), partial tiles
  run check 2 200 296 16 1 bdl bf16 32 1 1 1 1 1 1
  run check 2 272 104 16 2 bld bf16 32 1 1 1 1 1 1
  run check 1 96 40 12 1 bld f32 32 1 1 1 1 1 1
  run check 1 64 72 13 1 bdl bf16 64 1 1 1 1 1 1
  run check 1 64 0 16 1 bdl f32 32 1 1 1 1 1 1
  # the next tile copied ahead (2-byte inputs): a partial last tile behind a forward pass, a split sequence
  run check 2 256 304 16 1 bdl bf16 64 1 1 1 1 1 1
  run check 1 128 2000 16 1 bld bf16 32 1 1 1 1 1 1
  run check 1 128 520 16 0 bdl bf16 32 1 1 1 1 1 1
  # dstate 64 and 128 with 2-byte B/C staged in vectors (their swizzled shared rows)
  run check 2 128 160 64 1 bdl bf16 32 1 1 1 1 1 1
  run check 1 64 96 128 2 bld bf16 32 1 1 1 1 1 1
fi
if [ "$mode" != check ]; then
  run time 8 4096 2048 16 1 bdl bf16 32 1 1 1 1 0 0
  run time 8 4096 2048 16 1 bdl bf16 64 1 1 1 1 0 0
  run time 8 4096 2048 16 1 bld bf16 64 1 1 1 1 0 0
  run time 1 1536 2048 16 1 bdl bf16 64 1 1 1 1 0 0
  run time 1 1536 2048 16 1 bdl bf16 32 1 1 1 1 0 0
  run time 8 4096 2048 16 0 bdl bf16 64 1 1 1 1 0 0
  run time 8 4096 2048 64 1 bdl bf16 32 1 1 1 1 0 0
fi
echo "failures: $fails"
exit $((fails > 0))
