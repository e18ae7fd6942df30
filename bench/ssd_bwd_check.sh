#!/usr/bin/env bash
# On a GPU machine: builds bench/ssd_bwd_check.cu and runs its correctness matrix and timings.
#   bash bench/ssd_bwd_check.sh [check|time|all] [extra nvcc flags...]
# SSD_ARCH=90 builds the mma.sync first pass instead of the wgmma one (90a, the default on an H100).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mode="${1:-all}"
arch="${SSD_ARCH:-90a}"
nvcc -O3 -gencode=arch=compute_$arch,code=sm_$arch -std=c++17 -o /tmp/ssd_bwd_check bench/ssd_bwd_check.cu "${@:2}" || exit 1
fails=0
run() { echo "== $*"; /tmp/ssd_bwd_check "$@" || fails=$((fails + 1)); }
if [ "$mode" != time ]; then
  for partials in 0 1; do  # both ways to dB, dC (the library picks per shape: plan::mma_bwd_head_sums)
  export SSD_BWD_PARTIALS=$partials
  echo "== dB, dC: $([ $partials = 1 ] && echo per-head partials || echo head sums)"
  #         batch seqlen heads groups dstate dtype chunk D bias sp h0 dfin clamp
  run check 1 64 1 1 64 bf16 64 0 0 0 0 0 0
  run check 1 64 1 1 64 f16 64 1 1 1 1 1 0
  run check 2 200 4 2 128 f16 128 2 1 1 1 1 1
  run check 1 333 3 1 64 bf16 256 1 1 1 0 1 1
  run check 2 300 4 4 128 bf16 64 2 0 1 1 0 0
  run check 1 5 2 1 64 f16 64 1 1 1 1 1 0
  SSD_BWD_PARTS=3 run check 1 700 2 1 128 bf16 128 2 1 1 1 1 1
  SSD_BWD_PARTS=2 run check 2 200 2 2 64 f16 64 1 1 1 1 1 0
  # chunk 256 at dstate 128: a tile's entering state kept in registers, shared memory and scratch
  SSD_BWD_PARTS=2 run check 2 700 3 1 128 bf16 256 1 1 1 1 1 0
  run check 1 1000 2 1 128 f16 256 2 1 1 0 1 1
  done
  unset SSD_BWD_PARTIALS
fi
if [ "$mode" != check ]; then
  run time 8 2048 64 1 128 bf16 256 1 1 1 0 0 0
  run time 1 16384 64 1 128 bf16 256 1 1 1 0 0 0
  SSD_BWD_PARTIALS=1 run time 8 2048 64 8 128 bf16 256 1 1 1 0 0 0
fi
echo "failures: $fails"
exit $((fails > 0))
