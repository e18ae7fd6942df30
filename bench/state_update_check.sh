#!/usr/bin/env bash
# On a GPU machine with nvcc: build bench/state_update_check.cu once per knob setting (-D flags of
# kernels/decode.cuh), check and time every kernel variant on the issue's shapes and on
# correctness-only ones (groups, a pool with padding, a batch past the grid), and, when ncu is there
# and NCU=1, profile the variants named in NCU_VARIANTS on the main shape. Everything goes to stdout
# and to $OUT/state_update_check/.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}/state_update_check"
mkdir -p "$out"
knobs=("" "-DXLA_SSM_DECODE_SOFTPLUS=0" "-DXLA_SSM_STATE_CACHE=1")
for i in "${!knobs[@]}"; do
  nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 ${knobs[$i]} -o "$out/check$i" bench/state_update_check.cu &
done
wait
status=0
exec > >(tee "$out/log.txt") 2>&1
for shape in "256 5120 16" "1 4096 16" "8 4096 16" "64 5120 16" "37 200 16 4 1" "300000 1 16"; do
  "$out/check0" $shape || status=1
done
for i in 1 2; do
  echo "== knobs: ${knobs[$i]}"
  "$out/check$i" 256 5120 16 || status=1
done
if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
  ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section Occupancy --section WarpStateStats --section LaunchStats \
    "$out/check0" 256 5120 16 1 0 "only=${NCU_VARIANTS:-general/128,lib-fast,lib-fast-fused}" profile >"$out/ncu.txt" 2>&1 || status=1
  grep -E "^  [a-z_]|DRAM Throughput|Compute \(SM\)|Duration|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc A" "$out/ncu.txt"
fi
exit $status
