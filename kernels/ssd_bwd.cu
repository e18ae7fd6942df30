// Mamba-2 SSD backward on tensor cores (docs/ssd.md): bf16 / f16, headdim 64 (wider heads come as
// several heads of 64), dstate 64 or 128, chunk_size a multiple of 64. src/cuda/ssd.rs takes it
// where it applies. The kernels' entry points; the kernels themselves are in
//   ssd_bwd_mma.cuh     the main kernel (dx, dS, ddt and the parameters' partials; the math is there),
//                       its block and shared state in ssd_bwd_block.cuh
//   ssd_bwd_sums.cuh    the head sums: dB and dC summed over a group's heads a chunk at a time
//   ssd_bwd_reduce.cuh  gate_grad (with z, before the main kernel) and the fixed-order reductions
//   ssd_bwd_frags.cuh   the mma fragment and shared-tile helpers they share
#include "ssd_bwd_mma.cuh"
#include "ssd_bwd_reduce.cuh"
#include "ssd_bwd_sums.cuh"

// extern "C" entry points: ssd_bwd_mma[_local|_partials]_<T>_n<N> (grid (batch * heads, n_parts, or
// for _local n_records), kThreads threads, sizeof(BwdSmem<T, N>) bytes of dynamic shared memory); after _partials
// ssd_bwd_reduce_bc_<T> (grid-stride over (batch, seqlen, groups, dstate / 8)); else before it
// ssd_bwd_chunk_scalars_<T> (a warp per (batch, chunk, head)) and after it ssd_bwd_head_msum_<T> (grid
// batch * n_chunks * groups * msum_split, 32 kMsumWarps threads, msum_shared_bytes(chunk_size)),
// ssd_bwd_bc_sums_<T>_n<N> (grid (batch * n_chunks * groups, 2), 2 chunk_size threads,
// bc_shared_bytes<N>(chunk_size)), ssd_bwd_reduce_params (a block of kP threads per head);
// ssd_bwd_gate_grad_<T> (grid-stride over element pairs; before the main kernel, with z).
#define SSD_BWD_MMA(T, N)                                                                          \
    extern "C" __global__ void __launch_bounds__(ssd_mma::kThreads, 2)                             \
        ssd_bwd_mma_##T##_n##N(const ssd_mma::SsdBwdMmaParams a) {                                 \
        ssd_mma::ssd_bwd_mma<T, N, false, false>(a);                                               \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(ssd_mma::kThreads, 2)                             \
        ssd_bwd_mma_partials_##T##_n##N(const ssd_mma::SsdBwdMmaParams a) {                        \
        ssd_mma::ssd_bwd_mma<T, N, false, true>(a);                                                \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(ssd_mma::kThreads, 2)                             \
        ssd_bwd_mma_local_##T##_n##N(const ssd_mma::SsdBwdMmaParams a) {                           \
        ssd_mma::ssd_bwd_local<T, N>(a);                                                           \
    }
SSD_BWD_MMA(bf16, 64)
SSD_BWD_MMA(bf16, 128)
SSD_BWD_MMA(f16, 64)
SSD_BWD_MMA(f16, 128)
// 2 chunk_size threads, chunk_size <= 256.
#define SSD_BWD_BC_SUMS(T, N)                                                                      \
    extern "C" __global__ void __launch_bounds__(512, 1)                                           \
        ssd_bwd_bc_sums_##T##_n##N(const ssd_mma::SsdBwdMmaParams a) {                             \
        ssd_mma::bc_sums<T, N>(a);                                                                 \
    }
SSD_BWD_BC_SUMS(bf16, 64)
SSD_BWD_BC_SUMS(bf16, 128)
SSD_BWD_BC_SUMS(f16, 64)
SSD_BWD_BC_SUMS(f16, 128)
#define SSD_BWD_PER_TYPE(T)                                                                        \
    extern "C" __global__ void ssd_bwd_chunk_scalars_##T(const ssd_mma::SsdBwdMmaParams a) {       \
        ssd_mma::chunk_scalars<T>(a);                                                              \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * ssd_mma::kMsumWarps, 1)                      \
        ssd_bwd_head_msum_##T(const ssd_mma::SsdBwdMmaParams a) {                                  \
        ssd_mma::head_msum<T>(a);                                                                  \
    }                                                                                              \
    extern "C" __global__ void ssd_bwd_gate_grad_##T(const ssd_mma::SsdBwdMmaParams a) {           \
        ssd_mma::gate_grad<T>(a);                                                                  \
    }                                                                                              \
    extern "C" __global__ void ssd_bwd_reduce_bc_##T(const ssd_mma::SsdBwdMmaParams a) {           \
        ssd_mma::reduce_bc<T>(a);                                                                  \
    }
SSD_BWD_PER_TYPE(bf16)
SSD_BWD_PER_TYPE(f16)
extern "C" __global__ void __launch_bounds__(ssd_mma::kP)
    ssd_bwd_reduce_params(const ssd_mma::SsdBwdMmaParams a) {
    ssd_mma::reduce_params(a);
}
