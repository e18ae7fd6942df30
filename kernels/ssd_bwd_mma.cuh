// The tensor-core SSD backward's main kernel (docs/ssd.md), as a sequence of phases over one block's
// walk (ssd_bwd_block.cuh has the block and the state the phases share).
//
// One block of 4 warps walks one (batch, head) backwards through the sequence, the gradient dS of the
// state leaving the current 64-step tile in mma accumulators (warp w: rows p = 16w..). Per chunk, the
// states entering its tiles are first recomputed from the chunk's saved state (kept in registers,
// shared memory or scratch: see kScratchSlots). Per tile, with cum, dt, w as in the forward,
// L[t, s] = 2^(cum_t - cum_s) for s <= t, S the state entering the tile (rounded to T as an mma
// operand):
//   dx  = (B C^T o L)^T-ish products:  dx[s]  = dt_s sum_t L (C_t.B_s) dy_t + w_s (dS B_s) + D dy_s
//   dB[s] = dt_s sum_t L (dy_t.x_s) C_t + w_s x_s^T dS         (per head, summed over the group)
//   dC[t] = sum_s L dt_s (dy_t.x_s) B_s + 2^cum_t dy_t S        (likewise)
//   dS   <- 2^cum_last dS + sum_t 2^cum_t dy_t^T C_t
// and ddt / dA from the gradient of cum (see tile_dt_grads). Warp w computes the step-major
// products for rows s = 16w.. (columns t >= s) and, with the partials, t = 16w.. (columns s <= t);
// without them, the y term's rows t go mostly to the warps with less of the t >= s triangle
// (rows_t). dB and dC go one of two ways (src/ops/ssd/plan.rs `mma_bwd_head_sums` picks per shape):
// per head into partials as large as B and C times the group's heads, which reduce_bc sums
// (PARTIALS: few heads per group); or not formed here at all: the main kernel stores each chunk's S
// and dS and the head-sum kernels (ssd_bwd_sums.cuh) form dB and dC summed over the group's heads,
// a chunk at a time (that path's dx, S and dS leave through shared memory, copied out by warps 1-3
// while warp 0 forms ddt). dA, ddt_bias and dD go to per-(batch, head) partials; the reduce kernels
// sum in a fixed order (no atomics: bitwise-repeatable). Every phase is __forceinline__: the kernel
// stays one function, its arrays in registers.
#pragma once
#include "ssd_bwd_block.cuh"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "ssd_local_wgmma.cuh"
#endif

namespace ssd_mma {

// dS entering the walk: a part starts from dfinal_states folded back through the records of the
// parts after it, last to first (LOCAL: from zero).
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void start_ds(const BwdBlock<T, N, LOCAL, PARTIALS>& k, float (&ds)[N / 8][4]) {
    for_state_pairs<N>(ds, [&](float* acc, int row, int col) {
        float2 v = make_float2(0.f, 0.f);
        if (!LOCAL && k.a.q.dfinal_states)
            v = *reinterpret_cast<const float2*>(k.a.q.dfinal_states + k.bh * k.state_elems + row * N + col);
        acc[0] = v.x;
        acc[1] = v.y;
    });
    if (!LOCAL) {
        const int64_t after = k.part * k.a.records_per_part;  // the records of the parts after this one
        fold_records<N>(ds, k.records + k.bh * k.state_elems, k.record_decay + k.bh, k.bhs, n_records(k.a) - 1,
                        n_records(k.a) - after, -1);
    }
}

// LOCAL, the split's first pass: walks a record's piece back from dS = 0 and records the dS entering
// it and the piece's total decay, which the main kernel's parts fold (start_ds).
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void record_piece(const BwdBlock<T, N, LOCAL, PARTIALS>& k, const TileDt<T>& dt,
                                             float (&ds)[N / 8][4]) {
    const int64_t r = blockIdx.y;
    int64_t tile_begin, tile_end;
    record_tiles(k.a, r, tile_begin, tile_end);
    float decay_sum = 0.f;
    for (int64_t t0 = (tile_end - 1) * kQ; t0 >= tile_begin * kQ; t0 -= kQ) {
        k.load_tile(t0, false, true, dt);
        k.prefetch_tile(t0 - kQ, dt);
        decay_sum += k.sm.sc.cd[kQ / 2 - 1].z;
        k.update_ds(ds);
        __syncthreads();
    }
    float* rec = k.records + (r * k.bhs + k.bh) * k.state_elems;
    for_state_pairs<N>(ds, [&](float* acc, int row, int col) {
        *reinterpret_cast<float2*>(rec + row * N + col) = make_float2(acc[0], acc[1]);
    });
    if (k.tid == 0) k.record_decay[r * k.bhs + k.bh] = decay_sum;
}

// This thread's sums over the walk for the per-(batch, head) parameters' gradients, as references to
// the kernel's locals (like TileDt).
struct ParamGrads {
    float (&dd_acc)[kP / 8][2];       // sum of dy x over this thread's (rows, columns 8j + 2(lane%4) (+1))
    const float (&dskip)[kP / 8][2];  // D of those columns
    float& da_acc;                    // warp 0
    float& dbias_acc;
};

// The states entering a chunk's tiles, recomputed from its saved state walking forward: the last
// stays in sv, the ones before are kept (kept_slot) for the walk back.
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void recompute_states(const BwdBlock<T, N, LOCAL, PARTIALS>& k, const TileDt<T>& dt,
                                                 float (&sv)[N / 8][4], int64_t chunk, int64_t c0, int64_t tiles) {
    k.load_chunk_state(sv, chunk);
    if (!k.kLateWiden) k.widen_state(sv);
    for (int64_t j = 0; j + 1 < tiles; ++j) {
        k.load_tile(c0 + j * kQ, true, false, dt);
        k.prefetch_tile(c0 + (j + 1) * kQ, dt);  // the last one: the first of the walk back
        if (k.kLateWiden && j == 0) k.widen_state(sv);
        k.decay_add_product(sv, k.xs, k.sm.sc.w, k.bs);  // S <- 2^cum_last S + (w o x)^T B
        if (j + 2 < tiles) {
            uint4* slot = k.kept_slot(j + 1, tiles);
#pragma unroll
            for (int n = 0; n < N / 8; n += 2)
                slot[n / 2 * kThreads] = make_uint4(pack_u32<T>(sv[n][0], sv[n][1]), pack_u32<T>(sv[n][2], sv[n][3]),
                                                    pack_u32<T>(sv[n + 1][0], sv[n + 1][1]),
                                                    pack_u32<T>(sv[n + 1][2], sv[n + 1][3]));
        }
        __syncthreads();
    }
    if (k.kLateWiden && tiles == 1) k.widen_state(sv);
}

// <dS, S> (a sum per warp, for the gradient of cum), and S and dS rounded to T into shared memory as
// the products' operands.
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void stage_states(const BwdBlock<T, N, LOCAL, PARTIALS>& k, float (&ds)[N / 8][4],
                                             float (&sv)[N / 8][4]) {
    using O = Ops<T>;
    using T2 = typename O::T2;
    constexpr int PN = pitch<N>();
    float sds = 0.f;
#pragma unroll
    for (int n = 0; n < N / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) sds = fmaf(ds[n][e], sv[n][e], sds);
    for_state_pairs<N>(sv, [&](float* acc, int row, int col) {
        *reinterpret_cast<T2*>(&k.sm.s[row * PN + col]) = O::pack2(acc[0], acc[1]);
    });
    for_state_pairs<N>(ds, [&](float* acc, int row, int col) {
        *reinterpret_cast<T2*>(&k.sm.ds[row * PN + col]) = O::pack2(acc[0], acc[1]);
    });
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sds += __shfl_xor_sync(0xffffffffu, sds, o);
    if (k.lane == 0) k.sm.sds[k.warp] = sds;
}

// Rows s = 16 warp..: C_t . B_s (t-tiles >= 2 warp, as t >= s) and dS B_s, both summed over n, on
// the same A fragments of B.
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void s_products(const BwdBlock<T, N, LOCAL, PARTIALS>& k, float (&p1)[kQ / 8][4],
                                           float (&dx)[kP / 8][4]) {
    constexpr int PN = pitch<N>(), E = sizeof(T);
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
        uint32_t af[4];
        ldsm_x4(af, k.bs + ((16 * k.warp + k.a_rows) * PN + 16 * kk + k.a_cols) * E);
#pragma unroll
        for (int pr = 0; pr < kQ / 16; ++pr) {
            if (pr < k.warp) continue;  // t >= s
            uint32_t bb[4];
            ldsm_x4(bb, k.cs + ((16 * pr + k.bn_rows) * PN + 16 * kk + k.bn_cols) * E);
            mma_pair<T>(p1[2 * pr], p1[2 * pr + 1], af, bb);
        }
#pragma unroll
        for (int pr = 0; pr < kP / 16; ++pr) {
            uint32_t bb[4];
            ldsm_x4(bb, k.dss + ((16 * pr + k.bn_rows) * PN + 16 * kk + k.bn_cols) * E);
            mma_pair<T>(dx[2 * pr], dx[2 * pr + 1], af, bb);
        }
    }
}

// state_s = 2^(cum_last - cum_s) x_s . (dS B_s) into shared memory (a dt term of s); then dx = w_s dS B_s.
// Returns w_s at rows (r_lo, r_hi), which PARTIALS' dB takes too.
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ float2 state_term(const BwdBlock<T, N, LOCAL, PARTIALS>& k, const RowScalars& r,
                                             float (&dx)[kP / 8][4]) {
    constexpr int PX = pitch<kP>();
    const float2 xdot = row_dots<T, kP, PX>(dx, k.sm.x, k.r_lo, k.r_hi);
    const float decay_lo = ex2_ftz(r.cum_last - r.cum_lo), decay_hi = ex2_ftz(r.cum_last - r.cum_hi);
    const float st_lo = xdot.x * decay_lo, st_hi = xdot.y * decay_hi;
    if (k.lane % 4 == 0) {
        k.sm.state[k.r_lo] = st_lo;
        k.sm.state[k.r_hi] = st_hi;
    }
    const float w_lo = decay_lo * r.dt_lo, w_hi = decay_hi * r.dt_hi;
#pragma unroll
    for (int jn = 0; jn < kP / 8; ++jn) {
        dx[jn][0] *= w_lo, dx[jn][1] *= w_lo, dx[jn][2] *= w_hi, dx[jn][3] *= w_hi;
    }
    return make_float2(w_lo, w_hi);
}

// Rows s = 16 warp..: x_s . dy_t for t-tiles >= 2 warp.
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void x_dy_products(const BwdBlock<T, N, LOCAL, PARTIALS>& k, float (&g2)[kQ / 8][4]) {
    constexpr int PX = pitch<kP>(), E = sizeof(T);
#pragma unroll
    for (int kk = 0; kk < kP / 16; ++kk) {
        uint32_t af[4];
        ldsm_x4(af, k.xs + ((16 * k.warp + k.a_rows) * PX + 16 * kk + k.a_cols) * E);
#pragma unroll
        for (int pr = 0; pr < kQ / 16; ++pr) {
            if (pr < k.warp) continue;
            uint32_t bb[4];
            ldsm_x4(bb, k.dys + ((16 * pr + k.bn_rows) * PX + 16 * kk + k.bn_cols) * E);
            mma_pair<T>(g2[2 * pr], g2[2 * pr + 1], af, bb);
        }
    }
}

// Mask and decay: a1 = P1 L dt_s (the A fragments of dx's product with dy), V = P1 G2 L summed per
// column t (vcol, times dt_s) and per row s (intra), a2 = G2 L dt_s (PARTIALS: for dB).
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void mask_decay(const BwdBlock<T, N, LOCAL, PARTIALS>& k, const RowScalars& r,
                                           float (&p1)[kQ / 8][4], float (&g2)[kQ / 8][4], uint32_t (&a1)[kQ / 16][4],
                                           uint32_t (&a2)[kQ / 16][4]) {
    float in_lo = 0.f, in_hi = 0.f;
#pragma unroll
    for (int nt = 0; nt < kQ / 8; ++nt) {
        float vsum[2] = {0.f, 0.f};  // over rows, for columns t0, t0 + 1
        if (nt >= 2 * k.warp) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = 8 * nt + 2 * (k.lane % 4) + (e & 1), srow = e < 2 ? k.r_lo : k.r_hi;
                const float l = t >= srow ? ex2_ftz(k.cum_of(t) - (e < 2 ? r.cum_lo : r.cum_hi)) : 0.f;
                const float dts = e < 2 ? r.dt_lo : r.dt_hi;
                const float v = p1[nt][e] * g2[nt][e] * l;
                p1[nt][e] *= l * dts;
                if (PARTIALS) g2[nt][e] *= l * dts;
                (e < 2 ? in_lo : in_hi) += v;
                vsum[e & 1] += v * dts;
            }
        }
        // Sum over the 8 row groups of the warp (lanes with equal lane % 4).
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) vsum[e] += __shfl_xor_sync(0xffffffffu, vsum[e], o);
        }
        if (k.lane < 4) {
            k.sm.vcol[k.warp][8 * nt + 2 * k.lane] = vsum[0];
            k.sm.vcol[k.warp][8 * nt + 2 * k.lane + 1] = vsum[1];
        }
    }
    in_lo = quad_sum(in_lo);
    in_hi = quad_sum(in_hi);
    if (k.lane % 4 == 0) {
        k.sm.intra[k.r_lo] = in_lo;
        k.sm.intra[k.r_hi] = in_hi;
    }
#pragma unroll
    for (int pr = 0; pr < kQ / 16; ++pr) {
        to_a_frag<T>(a1[pr], p1[2 * pr], p1[2 * pr + 1]);
        if (PARTIALS) to_a_frag<T>(a2[pr], g2[2 * pr], g2[2 * pr + 1]);
    }
}

// dx += D dy; dD's sums of dy x; dx stored (the head sums: over this thread's x in shared memory,
// which nothing reads after this, for warps 1.. to copy out with the chunk states).
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void store_dx(const BwdBlock<T, N, LOCAL, PARTIALS>& k, float (&dx)[kP / 8][4], int64_t t0,
                                         const ParamGrads& pg) {
    using O = Ops<T>;
    using T2 = typename O::T2;
    constexpr int PX = pitch<kP>();
    T* dx_out = static_cast<T*>(k.a.q.dx);
    if constexpr (!PARTIALS) __syncwarp();  // the warp's ldmatrix reads of its x rows first
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = half ? k.r_hi : k.r_lo;
        const int64_t t = t0 + row;
#pragma unroll
        for (int jn = 0; jn < kP / 8; ++jn) {
            const int col = 8 * jn + 2 * (k.lane % 4);
            const float2 dyv = O::unpack2(*reinterpret_cast<const T2*>(&k.sm.dy[row * PX + col]));
            const float2 xv = O::unpack2(*reinterpret_cast<const T2*>(&k.sm.x[row * PX + col]));
            pg.dd_acc[jn][0] += dyv.x * xv.x;
            pg.dd_acc[jn][1] += dyv.y * xv.y;
            const T2 dxv =
                O::pack2(dx[jn][2 * half] + pg.dskip[jn][0] * dyv.x, dx[jn][2 * half + 1] + pg.dskip[jn][1] * dyv.y);
            if constexpr (!PARTIALS)
                *reinterpret_cast<T2*>(&k.sm.x[row * PX + col]) = dxv;
            else if (t < k.p.seqlen)
                *reinterpret_cast<T2*>(dx_out + ((k.b * k.p.seqlen + t) * k.p.heads + k.h) * kP + col) = dxv;
        }
    }
}

// Rows s = 16 warp..: dx, the dt terms of s (state_s, intra_s, V's columns), and PARTIALS: this head's
// dB = w_s x_s^T dS + a2 C.
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void rows_s(const BwdBlock<T, N, LOCAL, PARTIALS>& k, const RowScalars& r, int64_t t0,
                                       const ParamGrads& pg) {
    float p1[kQ / 8][4] = {};  // C_t . B_s for t-tiles >= 2 warp
    float dx[kP / 8][4] = {};  // first dS B_s, then dx
    s_products(k, p1, dx);
    const float2 w = state_term(k, r, dx);
    float g2[kQ / 8][4] = {};  // x_s . dy_t for t-tiles >= 2 warp
    x_dy_products(k, g2);
    uint32_t a1[kQ / 16][4], a2[kQ / 16][4];  // P1 L dt_s (for dx), G2 L dt_s (PARTIALS: for dB)
    mask_decay(k, r, p1, g2, a1, a2);
    add_upper_times_tile<T, kP, pitch<kP>()>(dx, a1, k.dys, k.warp, k.bt_rows, k.bt_cols);  // dx += a1 dy (over t)
    store_dx(k, dx, t0, pg);
    if constexpr (PARTIALS) {
        float db[N / 8][4] = {};
        rows_times_state<T, N>(db, k.xs, w.x, w.y, k.dss, k.warp);
        add_upper_times_tile<T, N, pitch<N>()>(db, a2, k.cs, k.warp, k.bt_rows, k.bt_cols);
        k.store_partial(db, k.a.db_part, t0);
    }
}

// PARTIALS: this head's dC = 2^cum_t dy_t S (in dc already) + a3 B, a3 = G2 L dt_s with G2 = dy_t . x_s
// for s-tiles <= warp.
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void add_dc_partial(const BwdBlock<T, N, LOCAL, PARTIALS>& k, const RowScalars& r,
                                               float (&dc)[N / 8][4], int64_t t0) {
    constexpr int PX = pitch<kP>(), PN = pitch<N>(), E = sizeof(T);
    float g2[kQ / 8][4] = {};  // dy_t . x_s for s-tiles <= warp
#pragma unroll
    for (int kk = 0; kk < kP / 16; ++kk) {
        uint32_t af[4];
        ldsm_x4(af, k.dys + ((16 * k.warp + k.a_rows) * PX + 16 * kk + k.a_cols) * E);
#pragma unroll
        for (int pr = 0; pr < kQ / 16; ++pr) {
            if (pr > k.warp) break;
            uint32_t bb[4];
            ldsm_x4(bb, k.xs + ((16 * pr + k.bn_rows) * PX + 16 * kk + k.bn_cols) * E);
            mma_pair<T>(g2[2 * pr], g2[2 * pr + 1], af, bb);
        }
    }
#pragma unroll
    for (int pr = 0; pr < kQ / 16; ++pr) {
        if (pr > k.warp) break;
        uint32_t a3[4];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float* acc = g2[2 * pr + half];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int s = 16 * pr + 8 * half + 2 * (k.lane % 4) + (e & 1), trow = e < 2 ? k.r_lo : k.r_hi;
                acc[e] = s <= trow ? acc[e] * ex2_ftz((e < 2 ? r.cum_lo : r.cum_hi) - k.cum_of(s)) * k.dt_of(s) : 0.f;
            }
        }
        to_a_frag<T>(a3, g2[2 * pr], g2[2 * pr + 1]);
#pragma unroll
        for (int q = 0; q < N / 16; ++q) {
            uint32_t bb[4];
            ldsm_x4_trans(bb, k.bs + ((16 * pr + k.bt_rows) * PN + 16 * q + k.bt_cols) * E);
            mma_pair<T>(dc[2 * q], dc[2 * q + 1], a3, bb);
        }
    }
    k.store_partial(dc, k.a.dc_part, t0);
}

// y0_t = 2^cum_t C_t . (dy_t S) for the rows t = 16 block.. into shared memory (the y term of the
// gradient of cum_t), leaving 2^cum_t dy_t S at this thread's rows of them in dc.
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void y0_rows(const BwdBlock<T, N, LOCAL, PARTIALS>& k, float (&dc)[N / 8][4], int block) {
    constexpr int PN = pitch<N>();
    const int lo = 16 * block + k.lane / 4, hi = lo + 8;
    rows_times_state<T, N>(dc, k.dys, k.sm.sc.ecum[lo], k.sm.sc.ecum[hi], k.ss, block);
    const float2 cdot = row_dots<T, N, PN>(dc, k.sm.c, lo, hi);
    if (k.lane % 4 == 0) {
        k.sm.y0[lo] = cdot.x;
        k.sm.y0[hi] = cdot.y;
    }
}

// The y0 rows, and PARTIALS: this head's dC, whose rows t = 16 warp.. start from 2^cum_t dy_t S. Without
// partials, y0's four 16-row blocks go to the warps with the least of rows_s' t >= s triangle (warp w
// has 4 - w of its blocks): warp 0 none, warps 1 and 2 one, warp 3 two (before, warp 0 did the most
// work of every tile and the others waited for it at the barrier after update_ds).
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void rows_t(const BwdBlock<T, N, LOCAL, PARTIALS>& k, const RowScalars& r, int64_t t0) {
    if constexpr (PARTIALS) {
        float dc[N / 8][4] = {};
        y0_rows(k, dc, k.warp);
        add_dc_partial(k, r, dc, t0);
    } else {
        static_assert(kWarps == 4, "the y0 blocks' assignment");
        const int first = k.warp == 3 ? 2 : k.warp - 1, last = k.warp == 3 ? 4 : k.warp;
#pragma unroll 1
        for (int block = max(first, 0); block < last; ++block) {
            float dc[N / 8][4] = {};
            y0_rows(k, dc, block);
        }
    }
}

// Warp 0: the gradient of cum, then ddt and dA. Lane l owns steps 2l and 2l + 1.
//   dCum_t = y0_t + sum_s V[t,s] dt_s - dt_t intra_t - dt_t state_t
//            (+ at the last step: 2^cum_last <dS, S> + sum_s dt_s state_s)
//   ddt_t  = intra_t + state_t + A sum_{t' >= t} dCum_t',  dA += dt_t sum_{t' >= t} dCum_t'
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void tile_dt_grads(const BwdBlock<T, N, LOCAL, PARTIALS>& k, const TileDt<T>& dt,
                                              const RowScalars& r, int64_t t0, const ParamGrads& pg) {
    float dcum[2], dts[2], direct[2];
    float u_sum = 0.f;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int t = 2 * k.lane + e;
        dts[e] = k.dt_of(t);
        float vc = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) vc += k.sm.vcol[w][t];
        direct[e] = k.sm.intra[t] + k.sm.state[t];
        dcum[e] = k.sm.y0[t] + vc - dts[e] * direct[e];
        u_sum += dts[e] * k.sm.state[t];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) u_sum += __shfl_xor_sync(0xffffffffu, u_sum, o);
    if (k.lane == 31) {
        float sds_all = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sds_all += k.sm.sds[w];
        dcum[1] += ex2_ftz(r.cum_last) * sds_all + u_sum;
    }
    // Suffix sums over the tile: R_t = sum_{t' >= t} dCum_t'.
    const float pair = dcum[0] + dcum[1];
    float suffix = pair;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float other = __shfl_down_sync(0xffffffffu, suffix, o);
        if (k.lane + o < 32) suffix += other;
    }
    const float r1 = suffix - pair + dcum[1], r0 = suffix;
    const float rs[2] = {r0, r1};
    T* ddt_out = static_cast<T*>(k.a.q.ddt);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int64_t t = t0 + 2 * k.lane + e;
        if (t >= k.p.seqlen) continue;
        const float ddt = direct[e] + k.A * rs[e];
        pg.da_acc += dts[e] * rs[e];
        // Through the clamp, softplus and bias to the raw dt (kept from the tile's load).
        const int64_t idx = (k.b * k.p.seqlen + t) * k.p.heads + k.h;
        const float v = dt.raw[e] + k.dt_bias;
        bool passes;
        ssd_dt(k.p, dt.raw[e], k.dt_bias, &passes);
        float graw = passes ? ddt : 0.f;
        if (k.p.dt_softplus) graw *= 1.f / (1.f + expf(-v));
        ddt_out[idx] = from_f32<T>(graw);
        pg.dbias_acc += graw;
    }
}

// The head sums' path, warps 1.. while warp 0 forms ddt: the tile's dx and the chunk's S (entering, at
// its first tile) and dS (leaving, at its last) from shared memory, in 16-byte pieces. (Stored from
// the registers, in 4-byte pieces, in the middle of the products, they cost the main kernel ~100 us
// at the main shape.)
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void store_chunk_tiles(const BwdBlock<T, N, LOCAL, PARTIALS>& k, int64_t t0, int64_t chunk,
                                                  int64_t tiles, int64_t j) {
    T* const dx = static_cast<T*>(k.a.q.dx) + ((k.b * k.p.seqlen + t0) * k.p.heads + k.h) * kP;
    copy_tile_out<T, kP>(dx, k.p.heads * kP, k.sm.x, int(min(int64_t(kQ), k.p.seqlen - t0)));
    const int64_t at = (k.bh * k.n_chunks + chunk) * k.state_elems;
    if (j == 0) copy_tile_out<T, N>(static_cast<T*>(k.a.s_chunk) + at, N, k.sm.s, kP);
    if (j == tiles - 1) copy_tile_out<T, N>(static_cast<T*>(k.a.ds_chunk) + at, N, k.sm.ds, kP);
}

// One tile of the walk back, tile j of a chunk at step c0: its products with the state entering it
// (sv) and the gradient leaving it (ds), then ds moved to the gradient entering it and sv to the state
// entering the tile before.
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void tile_backward(const BwdBlock<T, N, LOCAL, PARTIALS>& k, const TileDt<T>& dt,
                                              float (&ds)[N / 8][4], float (&sv)[N / 8][4], const ParamGrads& pg,
                                              int64_t chunk, int64_t c0, int64_t tiles, int64_t j) {
    const int64_t t0 = c0 + j * kQ;
    stage_states(k, ds, sv);
    k.load_tile(t0, true, true, dt);  // ends with __syncthreads: stage_states' writes are visible too
    k.prefetch_tile(j > 0 ? t0 - kQ : c0 - k.p.chunk_size, dt);  // the walk's next tile, or the chunk before's first
    const RowScalars r = k.row_scalars();
    rows_s(k, r, t0, pg);
    rows_t(k, r, t0);
    k.update_ds(ds);
    // (Unconditional: a conditional load would keep this tile's S live through the body.)
    k.load_entering(sv, chunk, tiles, j > 0 ? j - 1 : 0);
    __syncthreads();
    if (k.warp == 0)
        tile_dt_grads(k, dt, r, t0, pg);
    else if constexpr (!PARTIALS)
        store_chunk_tiles(k, t0, chunk, tiles, j);
    if (k.kLateWiden) k.widen_state(sv);  // load_entering's, after the work above
    __syncthreads();  // before the next tile's loads overwrite shared memory
}

// One chunk: the states entering its tiles, then its tiles from the last to the first.
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void chunk_backward(const BwdBlock<T, N, LOCAL, PARTIALS>& k, const TileDt<T>& dt,
                                               float (&ds)[N / 8][4], const ParamGrads& pg, int64_t chunk) {
    const int64_t c0 = chunk * k.p.chunk_size;
    const int64_t tiles = min(k.tiles_per_chunk, (k.p.seqlen - c0 + kQ - 1) / kQ);
    // S entering tile j (f32, this thread's accumulator positions). First the states entering
    // tiles 1..tiles-1 are recomputed; the last stays here, the others are kept (kept_slot).
    float sv[N / 8][4];
    recompute_states(k, dt, sv, chunk, c0, tiles);
    for (int64_t j = tiles - 1; j >= 0; --j) tile_backward(k, dt, ds, sv, pg, chunk, c0, tiles, j);
}

// dinitial_states, from the first part.
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void store_dinitial(const BwdBlock<T, N, LOCAL, PARTIALS>& k, float (&ds)[N / 8][4]) {
    if (k.part == 0 && k.a.q.dinitial_states) {
        for_state_pairs<N>(ds, [&](float* acc, int row, int col) {
            *reinterpret_cast<float2*>(k.a.q.dinitial_states + k.bh * k.state_elems + row * N + col) =
                make_float2(acc[0], acc[1]);
        });
    }
}

// The per-(part, batch, head) partials of dD, dA and ddt_bias (reduce_params sums them).
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void store_param_partials(const BwdBlock<T, N, LOCAL, PARTIALS>& k, const ParamGrads& pg) {
    // dD: sum the thread's columns over its rows (all lanes with equal lane % 4, all warps).
    // reused: kP floats (named through the extern array: through k.sm the compiler did not fold the
    // array's offset into the accesses' addresses)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float* dd_cols = reinterpret_cast<BwdSmem<T, N>*>(smem_raw)->intra;
    if (k.tid < kP) dd_cols[k.tid] = 0.f;
    __syncthreads();
#pragma unroll
    for (int jn = 0; jn < kP / 8; ++jn)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float v = pg.dd_acc[jn][e];
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            pg.dd_acc[jn][e] = v;
        }
    for (int w = 0; w < kWarps; ++w) {  // fixed order over warps
        if (k.warp == w && k.lane < 4) {
#pragma unroll
            for (int jn = 0; jn < kP / 8; ++jn) {
                dd_cols[8 * jn + 2 * k.lane] += pg.dd_acc[jn][0];
                dd_cols[8 * jn + 2 * k.lane + 1] += pg.dd_acc[jn][1];
            }
        }
        __syncthreads();
    }
    if (k.tid < kP) k.a.dd_part[(k.part * k.bhs + k.bh) * kP + k.tid] = dd_cols[k.tid];
    if (k.warp == 0) {  // each lane of warp 0 summed its own steps
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            pg.da_acc += __shfl_xor_sync(0xffffffffu, pg.da_acc, o);
            pg.dbias_acc += __shfl_xor_sync(0xffffffffu, pg.dbias_acc, o);
        }
        if (k.lane == 0) {
            k.a.da_part[k.part * k.bhs + k.bh] = pg.da_acc;
            k.a.dbias_part[k.part * k.bhs + k.bh] = pg.dbias_acc;
        }
    }
}

// PARTIALS: dB and dC per head into db_part / dc_part (reduce_bc sums them), for few heads per group;
// else each chunk's S and dS for the head-sum kernels (ssd_bwd_sums.cuh). LOCAL: the split's first
// pass (record_piece).
template <typename T, int N, bool LOCAL, bool PARTIALS>
__device__ __forceinline__ void ssd_bwd_mma(const SsdBwdMmaParams& a) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const BwdBlock<T, N, LOCAL, PARTIALS> k(a, *reinterpret_cast<BwdSmem<T, N>*>(smem_raw));
    float dt_raw[2];
    T dt_ahead[2];
    int64_t dt_ahead_t0 = -1;
    const TileDt<T> dt{dt_raw, dt_ahead, dt_ahead_t0};
    float ds[N / 8][4];  // dS: the gradient of the state leaving the current tile
    start_ds(k, ds);
    if (LOCAL) {
        record_piece(k, dt, ds);
        return;
    }
    float dd_acc[kP / 8][2] = {};
    float dskip[kP / 8][2];
    load_dskip(dskip, k.p, k.h);
    float da_acc = 0.f, dbias_acc = 0.f;
    const ParamGrads pg{dd_acc, dskip, da_acc, dbias_acc};
    for (int64_t chunk = k.chunk_end - 1; chunk >= k.chunk_begin; --chunk) chunk_backward(k, dt, ds, pg, chunk);
    store_dinitial(k, ds);
    store_param_partials(k, pg);
}

// The split's first pass: each piece of parts 1..n_parts-1 records the gradient entering it from its
// own steps and its total decay (grid: batch * heads, then records). On sm_90a at dstate 128 as one
// long wgmma product (ssd_local_wgmma.cuh).
template <typename T, int N> __device__ __forceinline__ void ssd_bwd_local(const SsdBwdMmaParams& a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (N == 128) {
        static_assert(local_shared_bytes<T, N>() <= int(sizeof(BwdSmem<T, N>)), "the launcher's shared memory");
        const SsdParams& p = a.q.fwd;
        const int64_t bh = blockIdx.x, b = bh / p.heads, h = bh % p.heads, g = h / (p.heads / p.groups);
        const int64_t bhs = p.batch * p.heads, state_elems = int64_t(kP) * N;
        int64_t tile_begin, tile_end;
        record_tiles(a, blockIdx.y, tile_begin, tile_end);
        const int64_t at = blockIdx.y * bhs + bh;
        float* record_decay = a.records + n_records(a) * bhs * state_elems;
        local_sum_wgmma<T, N, false>(p, b, h, g, a.q.dy, p.C, tile_begin, tile_end, a.records + at * state_elems,
                                     record_decay + at);
        return;
    }
#endif
    ssd_bwd_mma<T, N, true, false>(a);
}
}  // namespace ssd_mma
