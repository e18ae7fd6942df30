// The selective scan backward's kernels for packed sequences (cu_seqlens; the code:
// selective_scan_bwd.cuh; the reductions are selective_scan_bwd.cu's).
#include "selective_scan_bwd.cuh"

#define SSB_PACKED(T, TB) \
    SSB_TILED_TPCS(T, TB, tiled_packed, false, true) SSB_TILED_TPCS(T, TB, tiled_local_packed, true, true)
SCAN_TYPE_PAIRS(SSB_PACKED)
