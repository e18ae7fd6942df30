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
__device__ __forceinline__ void ssd_fwd(const SsdParams& p, const FwdSplit& split, bool scalars_in_y) {
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
            ssd_fwd_wgmma<T, N, GATED, PACKED>(p, split, scalars_in_y);
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
        ssd_mma::ssd_fwd<T, N, LOCAL, GATED, PACKED>(a.p, a.split, a.scalars_in_y != 0);              \
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

// The wgmma forward's tile scalars, formed ahead of it (src/cuda/ssd_mma.rs, `park_tile_scalars`):
// for each full 64-step tile of each (batch, head), a warp forms the tile's TileScalars as the kernel
// would (tile_scalars) and parks its 1024 bytes in y's first 8 rows of that tile, whole 128-byte rows
// (16 bytes at the start of each of the 64 rows made the L2 fetch every line of y: 49 us at
// 8 x 2048 x 64 x 64, against 12). The kernel copies them in with the tile's x, B and C, and
// overwrites the rows with y later. A block of 4 warps per (batch, tile, 4 heads), a warp a head,
// grid-stride; the block first copies the 4 heads' dt of the tile to shared memory. y is 16-byte
// aligned (the launcher's `aligned`).
static_assert(sizeof(ssd_mma::TileScalars) == 8 * ssd_mma::kP * 2, "a tile's scalars fill 8 rows of y");
template <typename T> __device__ __forceinline__ void ssd_fwd_tile_scalars(const SsdParams& p) {
    using namespace ssd_mma;
    constexpr int kWarps = 4;  // and heads a block
    __shared__ T dt[kWarps][kQ];
    __shared__ TileScalars sc[kWarps];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t full = p.seqlen / kQ, groups = (p.heads + kWarps - 1) / kWarps, n = p.batch * full * groups;
    for (int64_t u = blockIdx.x; u < n; u += gridDim.x) {
        const int64_t b = u / (full * groups), t0 = (u / groups % full) * kQ, h0 = u % groups * kWarps;
        const int heads = p.heads - h0 < kWarps ? int(p.heads - h0) : kWarps;
        const T* src = static_cast<const T*>(p.dt) + (b * p.seqlen + t0) * p.heads + h0;
        for (int e = threadIdx.x; e < kQ * heads; e += blockDim.x)
            dt[e % heads][e / heads] = src[e / heads * p.heads + e % heads];
        __syncthreads();
        if (warp < heads) {
            const int64_t h = h0 + warp;
            const T raw[2] = {dt[warp][2 * lane], dt[warp][2 * lane + 1]};
            tile_scalars(sc[warp], p, ssd_dt_bias(p, h), p.A[h] * kLog2e, t0, raw);
            __syncwarp();
            const uint4* from = reinterpret_cast<const uint4*>(&sc[warp]);
            for (int c = lane; c < kQ; c += 32)  // 16-byte chunk c: row c / 8, bytes 16 (c % 8)
                *reinterpret_cast<uint4*>(static_cast<T*>(p.y) + ((b * p.seqlen + t0 + c / 8) * p.heads + h) * kP +
                                          c % 8 * 8) = from[c];
        }
        __syncthreads();  // dt and sc are refilled for the next unit
    }
}
extern "C" __global__ void __launch_bounds__(128) ssd_fwd_tile_scalars_bf16(const SsdMmaParams a) {
    ssd_fwd_tile_scalars<bf16>(a.p);
}
extern "C" __global__ void __launch_bounds__(128) ssd_fwd_tile_scalars_f16(const SsdMmaParams a) {
    ssd_fwd_tile_scalars<f16>(a.p);
}
