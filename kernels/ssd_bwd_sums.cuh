// The tensor-core SSD backward's head sums (the path without per-head partials): dB and dC summed
// over a group's heads a chunk at a time, from x, dy, B, C and the S and dS the main kernel
// (ssd_bwd_mma.cuh) stores per chunk. chunk_scalars, then head_msum, then bc_sums.
#pragma once
#include "ssd_bwd_frags.cuh"
#include "wgmma.cuh"  // tile_byte, swizzled: the head sums' tiles (their wgmma only on sm_90a)

namespace ssd_mma {

// dB and dC, summed over a group's heads a chunk at a time (docs/ssd.md). With cum relative to the
// chunk's start and M[t, s] = sum_h 2^(cum_h,t - cum_h,s) dt_h,s (dy_h,t . x_h,s) for s <= t:
//   dC[t] = sum_s M[t, s] B_s + sum_h 2^cum_h,t dy_h,t S_h
//   dB[s] = sum_t M[t, s] C_t + sum_h 2^(cum_h,last - cum_h,s) dt_h,s x_h,s^T dS_h
// with S_h the state entering the chunk and dS_h the gradient of the state leaving it (both stored
// by the main kernel). chunk_scalars writes each step's {cum, dt}; head_msum sums M over a range of
// the heads, every 64 x 64 tile pair I >= J of the chunk; bc_sums then forms the chunk's dC or dB.
// Every sum runs in a fixed order: bitwise-repeatable.

// One warp per (batch, chunk, head), heads fastest: a block's warps take neighbouring heads of one
// chunk, whose dt loads (strided by heads) then share their sectors in L1 (13 -> 10 us at the main
// shape). It reads only dt, so it is launched programmatically after whatever precedes it (the
// forward, in a training step's vjp) and overlaps that kernel's last blocks; the kernels after it
// read that kernel's results, so it does not finish before that kernel has.
template <typename T> __device__ __forceinline__ void chunk_scalars(const SsdBwdMmaParams& a) {
    const SsdParams& p = a.q.fwd;
    const int lane = threadIdx.x & 31;
    const int64_t n_chunks = ssd_chunk_count(p);
    const int64_t item = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
    if (item < p.batch * p.heads * n_chunks) {
        const int64_t h = item % p.heads, chunk = item / p.heads % n_chunks, b = item / (p.heads * n_chunks);
        const float a_log2 = p.A[h] * kLog2e, dt_bias = ssd_dt_bias(p, h);
        float2* out = a.scal + ((b * p.heads + h) * n_chunks + chunk) * p.chunk_size;
        float carry = 0.f;
        for (int i0 = 0; i0 < p.chunk_size; i0 += kQ) {
            const int64_t t0 = chunk * p.chunk_size + i0;
            float raw[2], dt[2];
            load_dt_f32<T>(p, b, h, t0, raw);
#pragma unroll
            for (int e = 0; e < 2; ++e) dt[e] = t0 + 2 * lane + e < p.seqlen ? ssd_dt(p, raw[e], dt_bias) : 0.f;
            float a0 = dt[0] * a_log2, a1 = dt[1] * a_log2;
            if (p.cu_seqlens) {  // the packed backward's cut (TileCum)
                a0 += boundary_cut(p, t0 + 2 * lane);
                a1 += boundary_cut(p, t0 + 2 * lane + 1);
            }
            float run = a0 + a1;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float other = __shfl_up_sync(0xffffffffu, run, o);
                if (lane >= o) run += other;
            }
            const float c1 = carry + run;
            reinterpret_cast<float4*>(out + i0)[lane] = make_float4(c1 - a1, dt[0], c1, dt[1]);
            carry += __shfl_sync(0xffffffffu, run, 31);
        }
    }
    pdl_wait_prerequisite();
}

// Off-diagonal tile pair q of a chunk: rows I, columns J < I, q = I (I - 1) / 2 + J. (M's tiles are
// stored by pair k = I (I + 1) / 2 + J, the diagonal included.)
__device__ __forceinline__ int2 off_diagonal_pair(int q) {
    int i = 1;
    while ((i + 1) * i / 2 <= q) ++i;
    return make_int2(i, q - i * (i - 1) / 2);
}

// bc_sums' pipeline stages (3 or 4 were no faster); the library's launcher mirrors the count
// (cuda_mma.rs's shared memory sizes; the kernels trap on a mismatch).
constexpr int kBcStages = 2;
// head_msum sums a group's heads in at most this many ranges (plan.rs MSUM_MAX_SPLIT; bc_sums adds them).
constexpr int kMsumMaxSplit = 2;

// head_msum's shared memory: per pipeline stage a head's dy and x over the chunk and its {cum, dt};
// then, shared by the stages, x's rows but the last tile's scaled for the off-diagonal tiles. The rows
// (kP = 64 2-byte elements, 128 bytes) lie in wgmma::tile_byte's swizzled layout, each 64-row tile
// 1024-byte aligned (stages are whole KiB).
struct MsumStage {
    int64_t dy, x, sc, bytes;
    __device__ __host__ explicit MsumStage(int64_t chunk) {
        dy = 0;
        x = dy + chunk * kP * 2;
        sc = x + chunk * kP * 2;
        bytes = (sc + chunk * 8 + 1023) / 1024 * 1024;
    }
};
// The whole (mirror of msum_shared_bytes in src/cuda/ssd_mma.rs): two stages, the scaled x, and
// slack to align them to 1024 bytes.
__device__ __host__ inline int64_t msum_shared_bytes(int64_t chunk) {
    return 2 * MsumStage(chunk).bytes + (chunk - kQ) * kP * 2 + 1024;
}
constexpr int kMsumWarps = 8;
// Tasks (16 rows x 64 columns of one tile pair) per warp at chunk_size 256: 10 pairs x 4 / 8 warps.
constexpr int kMsumTasks = 5;

// Grid (batch * n_chunks * groups) x msum_split, kMsumWarps warps: each block reads its range of a
// group's heads' x and dy over the chunk once and forms every tile pair, the diagonal pairs' tasks
// (16 rows x 64 columns) first. Off the diagonal the decay is split between the operands (below).
// Task 4 q + r is rows 16 r.. of pair q, and warp w takes tasks w + 8 u: the four warps of a
// warpgroup hold one pair's four row blocks, so that on sm_90a the pair's products are the
// warpgroup's wgmma (dy and x in 128-byte-swizzled tiles; 153 -> 119 us at the main shape on an
// H200), elsewhere mma.sync. (Skipping the diagonal tiles' all-masked column blocks made the
// mma.sync version slower: 171 -> 226 us at the main shape.)
template <typename T> __device__ __forceinline__ void head_msum(const SsdBwdMmaParams& a) {
    extern __shared__ __align__(16) unsigned char smem_base[];
    unsigned char* const smem_raw = wgmma::align_1024(smem_base);
    pdl_launch_dependents();  // bc_sums waits for this grid before it starts
    const SsdParams& p = a.q.fwd;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, threads = blockDim.x;
    const int64_t n_chunks = ssd_chunk_count(p), hpg = p.heads / p.groups;
    const int n_tiles = int(p.chunk_size / kQ), pairs = n_tiles * (n_tiles + 1) / 2;
    const int64_t n_split = a.msum_split, split = blockIdx.x % n_split, unit = blockIdx.x / n_split;
    const int64_t g = unit % p.groups, chunk = unit / p.groups % n_chunks, b = unit / (p.groups * n_chunks);
    const int64_t h_begin = g * hpg + split * hpg / n_split, h_end = g * hpg + (split + 1) * hpg / n_split;
    const int64_t c0 = chunk * p.chunk_size;
    const MsumStage st(p.chunk_size);
    if (dynamic_smem_bytes() < msum_shared_bytes(p.chunk_size) || n_split > kMsumMaxSplit) __trap();  // a launcher out of step
    auto stage_ptr = [&](int stage, int64_t off) { return smem_raw + stage * st.bytes + off; };
    const T* x = static_cast<const T*>(p.x);
    const T* dy = static_cast<const T*>(a.q.dy);
    const int64_t row_stride = p.heads * kP, chunk_base = (b * p.seqlen + c0) * row_stride;
    const int valid_rows = int(min(p.chunk_size, p.seqlen - c0));
    auto load = [&](int64_t i, int stage) {
        const int64_t h = h_begin + i, base = chunk_base + h * kP;
        unsigned char* dys = stage_ptr(stage, st.dy);
        unsigned char* xs = stage_ptr(stage, st.x);
        for (int c = tid; c < p.chunk_size * (kP / 8); c += threads) {
            const int row = c / (kP / 8), col = c % (kP / 8) * 8;
            const bool valid = row < valid_rows;
            const int64_t off = valid ? base + row * row_stride + col : 0;
            cp_async16(dys + wgmma::swizzled(row, col), dy + off, valid);
            cp_async16(xs + wgmma::swizzled(row, col), x + off, valid);
        }
        const float2* sc = a.scal + ((b * p.heads + h) * n_chunks + chunk) * p.chunk_size;
        if (tid < p.chunk_size / 2) cp_async16(stage_ptr(stage, st.sc) + 16 * tid, sc + 2 * tid, true);
    };
    const int a_rows = lane & 15, a_cols = (lane >> 4) * 8;
    // Tasks: first the diagonal pairs' (kDiag per warp), then the others' (kOff per warp). Off the
    // diagonal (t in tile I > J, s in tile J ending at step Je), 2^(cum_t - cum_s) dt_s = [2^(cum_t -
    // cum_Je)] [2^(cum_Je - cum_s) dt_s], both factors <= 1 (times dt): the first scales the A
    // fragments' rows of dy, the second x's rows, once per head in a shared copy. The heads then sum
    // inside the mma accumulators, with no per-head epilogue.
    constexpr int kDiag = 2, kOff = kMsumTasks - kDiag;
    const int n_diag = 4 * n_tiles, n_off = 4 * (pairs - n_tiles);
    unsigned char* const x_scaled = smem_raw + 2 * st.bytes;
    float m[kMsumTasks][kQ / 8][4] = {};
    // A task's tile pair (I, J); tasks past the chunk's get pair (0, 0), whose products run (on sm_90a a
    // branch around a wgmma makes ptxas serialize them all) but are never used.
    int2 task_ij[kMsumTasks];
#pragma unroll
    for (int u = 0; u < kDiag; ++u) {
        const int task = warp + kMsumWarps * u;
        task_ij[u] = task < n_diag ? make_int2(task / 4, task / 4) : make_int2(0, 0);
    }
#pragma unroll
    for (int u = 0; u < kOff; ++u) {
        const int task = warp + kMsumWarps * u;
        task_ij[kDiag + u] = task < n_off ? off_diagonal_pair(task / 4) : make_int2(0, 0);
    }
    // (The copies, and x's scaled rows, reach the wgmma products' operand reads through the async proxy.)
    cp_async_pipeline<2, true>(h_end - h_begin, load, [&](int64_t, int stage) {
        const uint32_t dys = smem_addr(stage_ptr(stage, st.dy)), xs = smem_addr(stage_ptr(stage, st.x));
        const float2* sc = reinterpret_cast<const float2*>(stage_ptr(stage, st.sc));
        // x's rows s but the last tile's, times 2^(cum_Je - cum_s) dt_s (the previous head's
        // off-diagonal tasks are done: the pipeline's barrier).
        const unsigned char* x_raw = stage_ptr(stage, st.x);
        for (int c = tid; c < (p.chunk_size - kQ) * (kP / 8); c += threads) {
            const int row = c / (kP / 8), col = c % (kP / 8) * 8;
            const float2 s_row = sc[row];
            const float f = ex2_ftz(sc[row / kQ * kQ + kQ - 1].x - s_row.x) * s_row.y;
            const uint32_t at = wgmma::swizzled(row, col);
            scale8<T>(reinterpret_cast<T*>(x_scaled + at), reinterpret_cast<const T*>(x_raw + at), f);
        }
        // The A fragments of dy's rows t = t_row.. (the warp's 16; its warpgroup's 4 warps cover tile
        // t_row / kQ together), optionally scaled by f_lo, f_hi.
        auto dy_frags = [&](uint32_t (&af)[kP / 16][4], int t_row, bool scaled, float f_lo, float f_hi) {
#pragma unroll
            for (int kk = 0; kk < kP / 16; ++kk) {
                ldsm_x4(af[kk], dys + wgmma::swizzled(t_row + a_rows, 16 * kk + a_cols));
                if (scaled) scale_a_rows_t2<T>(af[kk], f_lo, f_hi);
            }
        };
        // acc (+)= A x_s^T over the 64 columns s of tile J of `xt` (A: dy_frags' fragments).
        auto products = [&](float (&acc)[kQ / 8][4], const uint32_t (&af)[kP / 16][4], uint32_t xt, int J) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
            const uint64_t x_desc = wgmma::desc(xt + J * wgmma::kBlockBytes, 16, wgmma::kSbo);  // K-major
#pragma unroll
            for (int kk = 0; kk < kP / 16; ++kk) wgmma::Ops<T>::template rs_n64<false>(acc, af[kk], x_desc + 2 * kk);
#else
            const int bn_rows = (lane & 7) + ((lane >> 4) << 3), bn_cols = ((lane >> 3) & 1) * 8;
#pragma unroll
            for (int kk = 0; kk < kP / 16; ++kk)
#pragma unroll
                for (int pr = 0; pr < kQ / 16; ++pr) {
                    uint32_t bb[4];
                    ldsm_x4(bb, xt + wgmma::swizzled(kQ * J + 16 * pr + bn_rows, 16 * kk + bn_cols));
                    mma_pair<T>(acc[2 * pr], acc[2 * pr + 1], af[kk], bb);
                }
#endif
        };
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        // On wgmma the diagonal pairs' products take both operands from shared memory, both issued
        // before either is waited for (every task's, also those past the chunk's: see task_ij).
        float gacc[kDiag][kQ / 8][4];  // dy_t . x_s
        wgmma::fence();
#pragma unroll
        for (int u = 0; u < kDiag; ++u) {
            const uint64_t dy_desc = wgmma::desc(dys + task_ij[u].x * wgmma::kBlockBytes, 16, wgmma::kSbo);
            const uint64_t x_desc = wgmma::desc(xs + task_ij[u].y * wgmma::kBlockBytes, 16, wgmma::kSbo);
#pragma unroll
            for (int kk = 0; kk < kP / 16; ++kk) wgmma::Ops<T>::ss_n64(gacc[u], dy_desc + 2 * kk, x_desc + 2 * kk, kk > 0);
        }
        wgmma::commit();
        wgmma::wait<0>();
#pragma unroll
        for (int u = 0; u < kDiag; ++u) wgmma::pin(gacc[u]);
#endif
#pragma unroll
        for (int u = 0; u < kDiag; ++u) {
            const int task = warp + kMsumWarps * u;
            if (task >= n_diag) break;
            const int2 ij = task_ij[u];
            const int t_row = kQ * ij.x + 16 * (task % 4), s_col = kQ * ij.y;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
            const float (&gacc_u)[kQ / 8][4] = gacc[u];
#else
            float gacc_u[kQ / 8][4] = {};  // dy_t . x_s
            uint32_t af[kP / 16][4];
            dy_frags(af, t_row, false, 0.f, 0.f);
            products(gacc_u, af, xs, ij.y);
#endif
            const int t_lo = t_row + lane / 4;
            const float cum_lo = sc[t_lo].x, cum_hi = sc[t_lo + 8].x;
#pragma unroll
            for (int nt = 0; nt < kQ / 8; ++nt) {
                const int s0 = s_col + 8 * nt + 2 * (lane % 4);
                const float4 cs = *reinterpret_cast<const float4*>(&sc[s0]);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int s = s0 + (e & 1), t = e < 2 ? t_lo : t_lo + 8;
                    const float cum_s = e & 1 ? cs.z : cs.x, dt_s = e & 1 ? cs.w : cs.y;
                    const float l = s <= t ? ex2_ftz((e < 2 ? cum_lo : cum_hi) - cum_s) * dt_s : 0.f;
                    m[u][nt][e] = fmaf(gacc_u[nt][e], l, m[u][nt][e]);
                }
            }
        }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        wgmma::fence_shared_to_async();  // this thread's scaled x rows, for the products below
#endif
        __syncthreads();  // the scaled x is complete
        const uint32_t xss = smem_addr(x_scaled);
        // Off the diagonal: dy's rows scaled by 2^(cum_t - cum_Je), into the accumulators. On wgmma all
        // the fragments are formed before the first product is issued (ptxas otherwise fences before
        // each one), and every task's products run (a task past the chunk's reads the raw x: the
        // scaled copy may have no rows).
        uint32_t af[kOff][kP / 16][4];
#pragma unroll
        for (int u = 0; u < kOff; ++u) {
            const int task = warp + kMsumWarps * u;
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
            if (task >= n_off) break;
#endif
            const int2 ij = task_ij[kDiag + u];
            const int t_row = kQ * ij.x + 16 * (task % 4), t_lo = t_row + lane / 4;
            const float cum_je = sc[kQ * ij.y + kQ - 1].x;
            dy_frags(af[u], t_row, true, ex2_ftz(sc[t_lo].x - cum_je), ex2_ftz(sc[t_lo + 8].x - cum_je));
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
            products(m[kDiag + u], af[u], xss, ij.y);
#endif
        }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        wgmma::fence();
#pragma unroll
        for (int u = 0; u < kOff; ++u) products(m[kDiag + u], af[u], warp + kMsumWarps * u < n_off ? xss : xs, task_ij[kDiag + u].y);
        wgmma::commit();
        wgmma::wait<0>();  // before the next head's loads overwrite the tiles
#pragma unroll
        for (int u = kDiag; u < kMsumTasks; ++u) wgmma::pin(m[u]);
#pragma unroll
        for (int u = 0; u < kOff; ++u)
#pragma unroll
            for (int kk = 0; kk < kP / 16; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(af[u][kk][r])::"memory");  // read until here
#endif
    });
#pragma unroll
    for (int u = 0; u < kMsumTasks; ++u) {
        const int task = warp + kMsumWarps * (u < kDiag ? u : u - kDiag);
        if (task >= (u < kDiag ? n_diag : n_off)) continue;
        const int2 ij = task_ij[u];
        const int pair = ij.x * (ij.x + 1) / 2 + ij.y;
        float* out = a.msum + ((unit * n_split + split) * pairs + pair) * kQ * kQ;
        const int r_lo = 16 * (task % 4) + lane / 4;
#pragma unroll
        for (int nt = 0; nt < kQ / 8; ++nt) {
            const int col = 8 * nt + 2 * (lane % 4);
            *reinterpret_cast<float2*>(&out[r_lo * kQ + col]) = make_float2(m[u][nt][0], m[u][nt][1]);
            *reinterpret_cast<float2*>(&out[(r_lo + 8) * kQ + col]) = make_float2(m[u][nt][2], m[u][nt][3]);
        }
    }
    // Launched programmatically after the main kernel, this grid must not finish before it: bc_sums
    // waits for this grid only, and reads the main kernel's S and dS.
    pdl_wait_prerequisite();
}

// A thread's share of copying a chunk's rows of one head (kP elements each, `row_stride` elements
// apart in global memory) into a shared tile of pitch pitch<kP>() with 2 chunk_size threads (bc_sums'
// blocks): 16-byte cp.async pieces of kPieces rows, chunk / 4 rows apart, at one column; rows from
// `valid_rows` on zero-filled. Set up once, so that a head's copy is an add or two a piece (a loop over
// the pieces with 64-bit index arithmetic was most of bc_sums' instructions; in head_msum, bound by
// its products' latencies, the same change saved nothing). Offsets fit 32 bits (heads * headdim *
// chunk_size < 2^31).
struct ChunkRows {
    static constexpr int kPieces = 4;  // chunk * kP / 8 pieces over 2 chunk threads
    int dst0, dst_step, src0, src_step;  // dst: bytes in the tile; src: elements from the head's first row
    uint32_t valid;                      // bit k: piece k lies inside the sequence
    __device__ __forceinline__ ChunkRows(int chunk, int valid_rows, int64_t row_stride) {
        const int row0 = threadIdx.x / (kP / 8), col = threadIdx.x % (kP / 8) * 8, row_step = chunk / kPieces;
        dst0 = (row0 * pitch<kP>() + col) * 2;
        dst_step = row_step * pitch<kP>() * 2;
        src0 = int(row0 * row_stride + col);
        src_step = int(row_step * row_stride);
        valid = 0;
#pragma unroll
        for (int k = 0; k < kPieces; ++k) valid |= uint32_t(row0 + k * row_step < valid_rows) << k;
    }
    // head_rows: the head's first row of the chunk (element (chunk start, head, 0)).
    template <typename T> __device__ __forceinline__ void issue(unsigned char* tile, const T* head_rows) const {
#pragma unroll
        for (int k = 0; k < kPieces; ++k) {
            const bool in = (valid >> k) & 1;
            cp_async16(tile + dst0 + k * dst_step, in ? head_rows + src0 + k * src_step : head_rows, in);
        }
    }
};
// bc_sums' shared memory, per pipeline stage: the chunk's rows (dy or x) of a head, its state tile
// (S or dS; first B or C tiles) in wgmma::tile_byte's 128-byte-swizzled layout (wgmma's operand
// layout, and free of bank conflicts for ldmatrix), the rows' {cum, dt} and the chunk's last two
// steps' {cum, dt}. Stages are whole 1024-byte units, so that every state tile is 1024-byte aligned.
template <int N> struct BcStage {
    int64_t rows, state, sc, last, bytes;  // byte offsets in a stage, and its size
    __device__ __host__ explicit BcStage(int64_t chunk) {
        rows = 0;
        state = rows + chunk * pitch<kP>() * 2;  // 2-byte elements; a multiple of 1024 (chunk: of 64)
        sc = state + int64_t(kP) * N * 2;
        last = sc + chunk * 8;
        bytes = (last + 16 + 1023) / 1024 * 1024;
    }
};
// The whole (mirror of bc_shared_bytes in src/cuda/ssd_mma.rs): the stages, plus slack to align
// them to 1024 bytes.
template <int N> __device__ __host__ inline int64_t bc_shared_bytes(int64_t chunk) {
    return kBcStages * BcStage<N>(chunk).bytes + 1024;
}

// acc += (rows o (lo, hi)) state over k = p, for the warp's rows 16 warp..: rows a (.. x kP) tile of
// pitch pitch<kP>() at shared address `rows`, whose two rows per thread are scaled by lo, hi; state a
// (kP x N) tile in tile_byte's layout at `state` (1024-byte aligned). On sm_90a one wgmma per 16 k
// for the warpgroup's 64 rows (the B operand read once per warpgroup, not once per warp), waited for
// before returning; elsewhere mma.sync.
template <typename T, int N>
__device__ __forceinline__ void rows_times_swizzled_state(float (&acc)[N / 8][4], uint32_t rows, float lo, float hi,
                                                          uint32_t state) {
    constexpr int PX = pitch<kP>(), E = sizeof(T);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int a_rows = lane & 15, a_cols = (lane >> 4) * 8;
    auto a_frag = [&](uint32_t (&af)[4], int kk) {  // rows' A fragment of k-block kk, scaled
        ldsm_x4(af, rows + ((16 * warp + a_rows) * PX + 16 * kk + a_cols) * E);
        scale_a_rows_split<T>(af, lo, hi);
    };
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    uint32_t af[kP / 16][4];  // all in registers until the products are done
#pragma unroll
    for (int kk = 0; kk < kP / 16; ++kk) a_frag(af[kk], kk);
    const uint64_t desc = wgmma::desc(state, wgmma::kLbo, wgmma::kSbo);  // N-major (n contiguous)
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kP / 16; ++kk) {
        const uint64_t at = desc + kk * 16 * 128 / 16;  // 16 rows of k further
        if constexpr (N == 128) wgmma::Ops<T>::rs_n128(acc, af[kk], at);
        else wgmma::Ops<T>::rs_n64(acc, af[kk], at);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(acc);
#else
    const int bt_rows = (lane & 7) + ((lane >> 3) & 1) * 8, bt_cols = (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < kP / 16; ++kk) {
        uint32_t af[4];
        a_frag(af, kk);
#pragma unroll
        for (int q = 0; q < N / 16; ++q) {
            uint32_t bb[4];
            ldsm_x4_trans(bb, state + wgmma::tile_byte(16 * kk + bt_rows, 16 * q + bt_cols));
            mma_pair<T>(acc[2 * q], acc[2 * q + 1], af, bb);
        }
    }
#endif
}

// Grid (batch * n_chunks * groups, 2), 2 * chunk_size threads: y = 0 forms dC for the chunk's rows t,
// y = 1 dB for its rows s. Warp w owns rows 16w.. (of tile w / 4). A block covers the whole chunk
// so that each head's S or dS tile is read once.
template <typename T, int N> __device__ __forceinline__ void bc_sums(const SsdBwdMmaParams& a) {
    extern __shared__ __align__(16) unsigned char smem_base[];
    unsigned char* const smem_raw = wgmma::align_1024(smem_base);
    // Launched programmatically after head_msum (which finishes after the main kernel): wait for it,
    // and let reduce_params launch (it waits for this grid in turn).
    pdl_wait_prerequisite();
    pdl_launch_dependents();
    using O = Ops<T>;
    using T2 = typename O::T2;
    const SsdParams& p = a.q.fwd;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, threads = blockDim.x;
    const int64_t n_chunks = ssd_chunk_count(p), hpg = p.heads / p.groups, state_elems = int64_t(kP) * N;
    const int n_tiles = int(p.chunk_size / kQ), pairs = n_tiles * (n_tiles + 1) / 2;
    const int64_t unit = blockIdx.x, g = unit % p.groups, chunk = unit / p.groups % n_chunks, b = unit / (p.groups * n_chunks);
    const bool is_db = blockIdx.y;
    const int64_t c0 = chunk * p.chunk_size;
    const int wt = warp / 4, r_lo = 16 * (warp % 4) + lane / 4, r_hi = r_lo + 8;  // rows within tile wt
    const int bt_rows = (lane & 7) + ((lane >> 3) & 1) * 8, bt_cols = (lane >> 4) * 8;
    const BcStage<N> st(p.chunk_size);
    if (dynamic_smem_bytes() < bc_shared_bytes<N>(p.chunk_size)) __trap();  // a launcher out of step with BcStage
    auto stage_ptr = [&](int stage, int64_t off) { return smem_raw + stage * st.bytes + off; };
    // A (64 x N) tile from rows t.. of `src` (batch, seqlen, groups, N) into a stage's state slot.
    auto copy_bc_tile = [&](const T* src, int64_t t, int stage) {
        unsigned char* dst = stage_ptr(stage, st.state);
        for (int c = tid; c < kQ * (N / 8); c += threads) {
            const int row = c / (N / 8), col = c % (N / 8) * 8;
            const bool valid = t + row < p.seqlen;
            cp_async16(dst + wgmma::tile_byte(row, col), src + (valid ? ((b * p.seqlen + t + row) * p.groups + g) * N + col : 0), valid);
        }
    };
    float acc[N / 8][4] = {};
    // M (or M^T) times B (or C), partner tile k: J = k <= wt (dC) or I = k >= wt (dB).
    const T* bc_src = static_cast<const T*>(is_db ? p.C : p.B);
    cp_async_pipeline<kBcStages>(n_tiles, [&](int64_t k, int stage) { copy_bc_tile(bc_src, c0 + kQ * k, stage); },
                                 [&](int64_t kk, int stage) {
        const int k = int(kk);
        if (is_db ? k < wt : k > wt) return;
        const int pair = is_db ? k * (k + 1) / 2 + wt : wt * (wt + 1) / 2 + k;
        const float* mt = a.msum + (unit * a.msum_split * pairs + pair) * kQ * kQ;
        // M[t, s], the head ranges summed. One range: the second read is the first's (an L1 hit) times 0
        // (a branch here made ptxas spill).
        const float* mt2 = mt + (a.msum_split - 1) * int64_t(pairs) * kQ * kQ;
        const float second = a.msum_split > 1 ? 1.f : 0.f;
        auto m_at = [&](int t, int s) { return fmaf(second, mt2[t * kQ + s], mt[t * kQ + s]); };
        const uint32_t bcs = smem_addr(stage_ptr(stage, st.state));
        // On the diagonal pair, M's 16-column blocks past (dC) or before (dB) the warp's rows are zero.
        const int pr_begin = k == wt && is_db ? warp % 4 : 0, pr_end = k == wt && !is_db ? warp % 4 + 1 : kQ / 16;
#pragma unroll
        for (int pr = 0; pr < kQ / 16; ++pr) {
            if (pr < pr_begin || pr >= pr_end) continue;
            const int c = 16 * pr + 2 * (lane % 4);
            uint32_t af[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int row = r & 1 ? r_hi : r_lo, col = c + (r >> 1) * 8;
                af[r] = is_db ? pack_u32<T>(m_at(col, row), m_at(col + 1, row))  // A[s, t] = M[t, s]
                              : pack_u32<T>(m_at(row, col), m_at(row, col + 1));
            }
#pragma unroll
            for (int q = 0; q < N / 16; ++q) {
                uint32_t bb[4];
                ldsm_x4_trans(bb, bcs + wgmma::tile_byte(16 * pr + bt_rows, 16 * q + bt_cols));
                mma_pair<T>(acc[2 * q], acc[2 * q + 1], af, bb);
            }
        }
    });
    // Plus the state terms, head by head.
    const T* rows_src = static_cast<const T*>(is_db ? p.x : a.q.dy);
    const T* state_src = static_cast<const T*>(is_db ? a.ds_chunk : a.s_chunk);
    // Per head: the chunk's rows and the state tile (contiguous in global memory).
    const ChunkRows rows(int(p.chunk_size), int(min(p.chunk_size, p.seqlen - c0)), p.heads * kP);
    const T* rows_chunk = rows_src + (b * p.seqlen + c0) * p.heads * kP;
    auto load_head = [&](int64_t hi, int stage) {
        const int64_t h = g * hpg + hi, bhc = (b * p.heads + h) * n_chunks + chunk;
        rows.issue(stage_ptr(stage, st.rows), rows_chunk + h * kP);
        unsigned char* state = stage_ptr(stage, st.state);
        const T* ssrc = state_src + bhc * state_elems;
        for (int c = tid; c < kP * (N / 8); c += threads)
            cp_async16(state + wgmma::tile_byte(c / (N / 8), c % (N / 8) * 8), ssrc + 8 * c, true);
        const float2* sc = a.scal + bhc * p.chunk_size;
        if (tid < p.chunk_size / 2) cp_async16(stage_ptr(stage, st.sc) + 16 * tid, sc + 2 * tid, true);
        if (tid == threads - 1) cp_async16(stage_ptr(stage, st.last), sc + p.chunk_size - 2, true);
    };
    // (The copies then reach wgmma's operand reads through the async proxy.)
    cp_async_pipeline<kBcStages, true>(hpg, load_head, [&](int64_t, int stage) {
        const float2* sc = reinterpret_cast<const float2*>(stage_ptr(stage, st.sc));
        const float2 lo = sc[16 * warp + lane / 4], hi = sc[16 * warp + lane / 4 + 8];
        float f_lo, f_hi;
        if (is_db) {  // 2^(cum_last - cum_s) dt_s
            const float cum_last = reinterpret_cast<const float4*>(stage_ptr(stage, st.last))->z;
            f_lo = ex2_ftz(cum_last - lo.x) * lo.y;
            f_hi = ex2_ftz(cum_last - hi.x) * hi.y;
        } else {  // 2^cum_t
            f_lo = ex2_ftz(lo.x);
            f_hi = ex2_ftz(hi.x);
        }
        rows_times_swizzled_state<T, N>(acc, smem_addr(stage_ptr(stage, st.rows)), f_lo, f_hi,
                                        smem_addr(stage_ptr(stage, st.state)));
    });
    T* out = static_cast<T*>(is_db ? a.q.dB : a.q.dC);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int64_t t = c0 + 16 * warp + lane / 4 + 8 * half;
        if (t >= p.seqlen) continue;
        T* dst = out + ((b * p.seqlen + t) * p.groups + g) * N + 2 * (lane % 4);
#pragma unroll
        for (int q = 0; q < N / 8; ++q) *reinterpret_cast<T2*>(dst + 8 * q) = O::pack2(acc[q][2 * half], acc[q][2 * half + 1]);
    }
}

}  // namespace ssd_mma
