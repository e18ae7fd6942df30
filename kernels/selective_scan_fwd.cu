// The selective scan forward's kernels without packed sequences (the code: selective_scan_fwd.cuh;
// the packed ones are selective_scan_fwd_packed.cu, a file of their own so that nvcc compiles the
// two halves in parallel).
#include "selective_scan_fwd.cuh"

#define SSF_UNPACKED(T, TB)                                                                       \
    SSF_LANES(T, TB, lanes, false) SSF_TILED_FORMS(T, TB, 1, tiled, false, false)                 \
    SSF_TILED_TPCS(T, TB, tiled, false, false) SSF_TILED_TPCS(T, TB, tiled_local, true, false)
SCAN_TYPE_PAIRS(SSF_UNPACKED)
