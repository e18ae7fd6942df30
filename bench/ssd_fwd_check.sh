#!/usr/bin/env bash
# On a GPU machine: builds bench/ssd_fwd_check.cu and runs its correctness matrix and timings.
#   bash bench/ssd_fwd_check.sh [check|time|all] [extra nvcc flags...]
# SSD_ARCH=90 builds the mma.sync kernel instead of the wgmma one (90a, the default on an H100).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mode="${1:-all}"
arch="${SSD_ARCH:-90a}"
wgmma=0
[ "$arch" = 90a ] && wgmma=1
nvcc -O3 -gencode=arch=compute_$arch,code=sm_$arch -std=c++17 -DSSD_WGMMA=$wgmma -o /tmp/ssd_fwd_check bench/ssd_fwd_check.cu "${@:2}" || exit 1
fails=0
run() { echo "== $*"; /tmp/ssd_fwd_check "$@" || fails=$((fails + 1)); }
if [ "$mode" != time ]; then
  #         batch seqlen heads groups dstate dtype chunk D z bias sp h0 clamp parts
  run check 1 64 1 1 64 bf16 64 0 0 0 0 0 0 1
  run check 2 200 4 2 128 bf16 64 1 1 1 1 1 0 1
  run check 2 200 4 2 128 f16 128 2 1 1 1 1 1 1
  run check 1 333 3 1 64 bf16 256 1 0 1 1 0 1 1
  run check 1 333 3 3 64 f16 64 2 1 0 0 1 0 3
  run check 2 1000 2 1 128 bf16 256 1 1 1 1 1 0 4
  run check 1 130 2 1 128 bf16 64 0 0 0 1 1 0 7
  run check 3 100 3 1 128 bf16 64 1 1 1 1 1 0 2
  run check 1 5 2 1 64 f16 64 1 1 1 1 1 0 0
  run check 1 0 2 1 64 bf16 64 1 1 1 1 1 0 0
  # The launcher's split (parts 0): 9 parts, the first pass in 2 pieces a part (plan::mma_fwd_split).
  run check 2 1087 8 2 128 bf16 64 1 1 1 1 1 0 0
  run check 1 1087 16 4 64 f16 128 2 0 1 1 0 1 0
  # More pieces a part than the launcher's rule gives here (its other rule's counts).
  SSD_FWD_RECORDS=3 run check 2 1000 2 1 128 bf16 64 1 1 1 1 1 0 4
  SSD_FWD_RECORDS=4 run check 1 1100 3 1 64 f16 64 1 0 1 1 1 0 3
  # The inference forward (no chunk states) over several chunks, split and not.
  SSD_NO_CHUNK_STATES=1 run check 2 1000 2 1 128 bf16 64 1 1 1 1 1 0 4
  SSD_NO_CHUNK_STATES=1 run check 1 1087 16 4 64 f16 128 2 0 1 1 0 1 0
fi
if [ "$mode" != check ]; then
  run time 8 2048 64 1 128 bf16 256 1 0 1 1 0 0 0
  run time 1 16384 64 1 128 bf16 256 1 0 1 1 0 0 0
  run time 1 16384 64 1 128 bf16 256 1 0 1 1 0 0 1
  run time 8 2048 64 8 128 bf16 256 1 1 1 1 0 0 0
  run time 8 2048 64 1 64 f16 256 1 0 1 1 0 0 0
fi
echo "failures: $fails"
exit $((fails > 0))
