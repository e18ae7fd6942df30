// The selective scan forward's kernels for packed sequences (cu_seqlens; the code:
// selective_scan_fwd.cuh).
#include "selective_scan_fwd.cuh"

#define SSF_PACKED(T, TB)                                                                          \
    SSF_LANES(T, TB, lanes_packed, true) SSF_TILED_FORMS(T, TB, 1, tiled_packed, false, true)      \
    SSF_TILED_TPCS(T, TB, tiled_packed, false, true) SSF_TILED_TPCS(T, TB, tiled_local_packed, true, true)
SCAN_TYPE_PAIRS(SSF_PACKED)
