// Mamba-2 SSD forward on tensor cores (docs/ssd.md): bf16 / f16 inputs, headdim 64 (wider heads come
// as several heads of 64), dstate 64 or 128, chunk_size a multiple of 64. src/cuda/ssd.rs takes it
// where it applies; the generic path covers the rest. Two kernels, one per instruction set: wgmma on
// sm_90a at dstate 128 (ssd_fwd_wgmma.cuh: H100 8x2048x64x64x128 bf16 302 us with chunk states
// against 355) and mma.sync otherwise (ssd_fwd_sync.cuh). Both scan one (batch, head) per block of 128 threads through 64-step tiles,
// the state in accumulators.
//
// Sequence split (few batch x heads): pass 1 (`_local`) runs parts 0..n_parts-2, each in pieces
// (FwdSplit, kernels/params.h), from a zero state and records each piece's end state and total
// decay in the workspace; pass 2 runs every part, starting from the initial state folded through the
// records before it.
//
// Packed sequences (`_packed`, docs/ssd.md): kernels of their own, whose tiles are cut at the
// boundaries (Windows, ssd_fwd_common.cuh). In the unpacked kernels the boundaries' code, even
// skipped, slowed the forward (8x2048x64x64x128 bf16 on an H200: 231 -> 251 us).
#include "ssd_fwd_sync.cuh"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "ssd_fwd_wgmma.cuh"
#include "ssd_local_wgmma.cuh"
#endif

namespace ssd_mma {
// wgmma at dstate 128 on sm_90a; at dstate 64 the mma.sync kernel is the faster one there (f16
// 8x2048x64x64x64: 248 us against 266).
template <typename T, int N, bool LOCAL, bool GATED, bool PACKED>
__device__ __forceinline__ void ssd_fwd(const SsdParams& p, const FwdSplit& split) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (N == 128) {
        if constexpr (LOCAL) {
            static_assert(local_shared_bytes<T, N>() <= int(sizeof(SyncSmem<T, N>)), "the launcher's shared memory");
            const FwdBlock blk(p, split, std::true_type{});
            const PartRecords rec = PartRecords::make<N>(p, split);
            const int64_t at = blk.part * rec.per_part + blk.bh;
            local_sum_wgmma<T, N, true, PACKED>(p, blk.b, blk.h, blk.g, p.x, p.B, blk.tile_begin, blk.tile_end,
                                                rec.states + at * kP * N, rec.decays + at);
        } else {
            ssd_fwd_wgmma<T, N, GATED, PACKED>(p, split);
        }
        return;
    }
#endif
    ssd_fwd_sync<T, N, LOCAL, GATED, PACKED>(p, split);
}
}  // namespace ssd_mma

// extern "C" entry points ssd_fwd_mma[_gated]<P>_<T>_n<N> (_gated: with z) and
// ssd_fwd_mma_local<P>_<T>_n<N> (the split's first pass, which writes no y), <P> empty or _packed;
// grid (batch * heads, parts), kThreads threads, sizeof(SyncSmem<T, N>) bytes of dynamic shared
// memory (the larger of the two kernels' needs).
#define SSD_FWD_MMA_KERNEL(T, N, NAME, LOCAL, GATED, PACKED)                                          \
    extern "C" __global__ void __launch_bounds__(ssd_mma::kThreads, 2) NAME(const SsdMmaParams a) {   \
        pdl_launch_dependents(); /* the backward's chunk_scalars reads none of this kernel's output */ \
        ssd_mma::ssd_fwd<T, N, LOCAL, GATED, PACKED>(a.p, a.split);                                   \
    }
#define SSD_FWD_MMA(T, N)                                                                             \
    SSD_FWD_MMA_KERNEL(T, N, ssd_fwd_mma_##T##_n##N, false, false, false)                             \
    SSD_FWD_MMA_KERNEL(T, N, ssd_fwd_mma_gated_##T##_n##N, false, true, false)                        \
    SSD_FWD_MMA_KERNEL(T, N, ssd_fwd_mma_local_##T##_n##N, true, false, false)                        \
    SSD_FWD_MMA_KERNEL(T, N, ssd_fwd_mma_packed_##T##_n##N, false, false, true)                       \
    SSD_FWD_MMA_KERNEL(T, N, ssd_fwd_mma_gated_packed_##T##_n##N, false, true, true)                  \
    SSD_FWD_MMA_KERNEL(T, N, ssd_fwd_mma_local_packed_##T##_n##N, true, false, true)
SSD_FWD_MMA(bf16, 64)
SSD_FWD_MMA(bf16, 128)
SSD_FWD_MMA(f16, 64)
SSD_FWD_MMA(f16, 128)

// ssd_part_records' fold (src/cuda/ssd_mma.rs, `part_records`): each (batch, head)'s end state from
// zero, acc <- 2^decay_r acc + state_r over the parts' records in order (as `fold_records`), into the
// final states. `a.split` is the records' split, of n_parts + 1 parts: n_parts records. Grid-stride
// over the (batch * heads) x kP x N floats, 256 threads a block.
extern "C" __global__ void __launch_bounds__(256) ssd_fold_part_records(const SsdMmaParams a) {
    const SsdParams& p = a.p;
    const int64_t bh = p.batch * p.heads, state = int64_t(ssd_mma::kP) * p.dstate, n = a.split.n_parts - 1;
    const float* states = static_cast<const float*>(p.workspace);
    const float* decays = states + n * bh * state;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < bh * state;
         i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t row = i / state;
        float acc = 0.f;
        for (int64_t r = 0; r < n; ++r) acc = fmaf(exp2f(decays[r * bh + row]), acc, states[r * bh * state + i]);
        p.final_states[i] = acc;
    }
}
