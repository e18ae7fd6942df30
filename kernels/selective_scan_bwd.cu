// The selective scan backward's kernels without packed sequences, and its reductions (the code:
// selective_scan_bwd.cuh; the packed kernels are selective_scan_bwd_packed.cu, a file of their own
// so that nvcc compiles the two halves in parallel).
#include "selective_scan_bwd.cuh"

#define SSB_UNPACKED(T, TB) \
    SSB_TILED_TPCS(T, TB, tiled, false, false) SSB_TILED_TPCS(T, TB, tiled_local, true, false)
SCAN_TYPE_PAIRS(SSB_UNPACKED)
SSB_REDUCE(f32)
SSB_REDUCE(bf16)
SSB_REDUCE(f16)
