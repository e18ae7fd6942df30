// The SSD forward on mma.sync (any sm_80+ GPU; ssd_fwd.cu takes ssd_fwd_wgmma.cuh on sm_90a instead).
//
// One block of 4 warps scans one (batch, head) through the sequence in tiles of 64 steps, the state S
// (headdim x dstate, f32) living in the warps' mma accumulators (warp w: rows p = 16w..16w+15). Per
// tile, with cum_t the running sum of dt * A inside the tile (log2 units):
//   y  = diag(2^cum) C S^T  +  ((C B^T) o M) x,   M[t, s] = 2^(cum_t - cum_s) dt_s for s <= t, else 0
//   S <- 2^cum_last S  +  (w o x)^T B,             w_s = 2^(cum_last - cum_s) dt_s
// (warp w: rows t = 16w..16w+15 of y; the masked C B^T never leaves registers: its accumulators are
// the A operand of the product with x). Inputs stream through shared memory by cp.async, one tile
// ahead. S enters the y products rounded to T, as the products themselves take T operands.
#pragma once
#include "ssd_fwd_common.cuh"

namespace ssd_mma {

template <typename T, int N> struct SyncSmem {
    T x[2][kQ * pitch<kP>()];
    T b[2][kQ * pitch<N>()];
    T c[2][kQ * pitch<N>()];
    T s[kP * pitch<N>()];  // the state entering the tile, rounded to T (the y products' operand)
    TileScalars sc[2];     // of the tile in x/b/c[buf]
};
// The launcher sizes shared memory by this formula (src/cuda/ssd_mma.rs).
static_assert(sizeof(SyncSmem<bf16, 128>) == 20480 + 640 * (128 + 8) && sizeof(SyncSmem<f16, 64>) == 20480 + 640 * (64 + 8),
              "mirror of fwd_shared_bytes (src/cuda/ssd_mma.rs)");

// GATED: y times silu(z), a kernel of its own: with the gate's code in it (skipped at run time) the
// ungated forward took 380 us instead of 356 at 8x2048x64x64x128.
template <typename T, int N, bool LOCAL, bool GATED, bool PACKED>
__device__ __forceinline__ void ssd_fwd_sync(const SsdParams& p, const FwdSplit& split) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    SyncSmem<T, N>& sm = *reinterpret_cast<SyncSmem<T, N>*>(smem_raw);
    using O = Ops<T>;
    using T2 = typename O::T2;
    constexpr int PX = pitch<kP>(), PN = pitch<N>();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rb = warp;  // row block of y and S
    const FwdBlock blk(p, split, std::integral_constant<bool, LOCAL>{});
    const int64_t bh = blk.bh, part = blk.part, b = blk.b, h = blk.h;
    const int64_t tile_begin = blk.tile_begin, tile_end = blk.tile_end;
    const float a_log2 = p.A[h] * kLog2e, dt_bias = ssd_dt_bias(p, h);
    const PartRecords rec = PartRecords::make<N>(p, split);

    // The state entering the part.
    float s[N / 8][4];
    load_part_state<N, LOCAL, PACKED>(s, p, rec, bh, part * split.records_per_part);
    float dskip[kP / 8][2];
    load_dskip(dskip, p, h);

    const TileLoads<T, N> loads(p, blk);
    auto load_tile = [&](int buf, int64_t t0, int rows) {
        loads.template issue<!LOCAL>(
            t0, rows, sm.x[buf], sm.b[buf], sm.c[buf], [](int r, int c) { return uint32_t((r * PX + c) * sizeof(T)); },
            [](int r, int c) { return uint32_t((r * PN + c) * sizeof(T)); });
    };

    // Warp 0 computes a tile's scalars one tile ahead of the others (it has the least mma work).
    float decay_sum = 0.f;  // log2 of the part's total decay (LOCAL records it)

    // Per-lane ldmatrix byte offsets into a tile of pitch 1 element; the loops add compile-time offsets.
    const int a_rows = lane & 15, a_cols = (lane >> 4) * 8;                               // A, row-major
    const int bn_rows = (lane & 7) + ((lane >> 4) << 3), bn_cols = ((lane >> 3) & 1) * 8;  // B, n-major
    const int bt_rows = (lane & 7) + ((lane >> 3) & 1) * 8, bt_cols = (lane >> 4) * 8;     // B, k-major
    const int at_rows = (lane & 7) + (lane >> 4) * 8, at_cols = ((lane >> 3) & 1) * 8;     // A, k-major
    constexpr int E = sizeof(T);

    // The part's windows (its tiles; PACKED: cut at the sequences' boundaries).
    PartWindows<PACKED> win(p, tile_begin, tile_end);
    if (win.more()) load_tile(win.buf(), win.start(), win.rows());
    cp_async_commit();
    T dt_raw[2];
    if (warp == 0) {
        load_dt<T>(p, b, h, win.start(), dt_raw);
        tile_scalars(sm.sc[win.buf()], p, dt_bias, a_log2, win.start(), dt_raw, true, win.stop());
        load_dt<T>(p, b, h, win.next_start(), dt_raw);
    }

    for (; win.more(); win.advance()) {
        const int buf = win.buf();
        const int64_t t0 = win.start();
        // z is read straight from global memory by the epilogue: pull this tile's rows (one line
        // each) into L2 now, half a tile before its use (gated forward 710 -> 645 us; silu did the rest).
        if (GATED && tid < kQ && win.inside(tid))
            prefetch_l2(static_cast<const T*>(p.z) + ((b * p.seqlen + t0 + tid) * p.heads + h) * kP);
        if (win.has_next()) load_tile(buf ^ 1, win.next_start(), win.next_rows());
        cp_async_commit();
        cp_async_wait_one();
        __syncthreads();

        const TileScalars& sc = sm.sc[buf];
        const float cum_last = sc.cd[kQ / 2 - 1].z;
        decay_sum += cum_last;
        const uint32_t xs = smem_addr(sm.x[buf]), bs = smem_addr(sm.b[buf]), cs = smem_addr(sm.c[buf]);
        if (!LOCAL) store_chunk_state<T, N>(s, p, bh, t0);
        if (PACKED && reset_at<N>(s, p, win.starts, h, t0, !LOCAL)) decay_sum = -INFINITY;
        if (!LOCAL) {
            for_state_pairs<N>(s, [&](float* acc, int row, int col) {
                *reinterpret_cast<T2*>(&sm.s[row * PN + col]) = O::pack2(acc[0], acc[1]);
            });
            __syncthreads();

            // y for rows t = 16 rb + lane/4 (+8).
            float y[kP / 8][4] = {};
            float gm[kQ / 8][4] = {};
            const uint32_t c_lane = cs + ((16 * rb + a_rows) * PN + a_cols) * E;
            const uint32_t b_lane = bs + (bn_rows * PN + bn_cols) * E;
            const uint32_t s_lane = smem_addr(sm.s) + ((bn_rows) * PN + bn_cols) * E;
#pragma unroll
            for (int kk = 0; kk < N / 16; ++kk) {
                uint32_t a[4];
                ldsm_x4(a, c_lane + 16 * kk * E);
#pragma unroll
                for (int pr = 0; pr < kQ / 16; ++pr) {
                    if (pr > rb) break;  // causal: s <= t
                    uint32_t bb[4];
                    ldsm_x4(bb, b_lane + (16 * pr * PN + 16 * kk) * E);
                    mma_pair<T>(gm[2 * pr], gm[2 * pr + 1], a, bb);
                }
#pragma unroll
                for (int pr = 0; pr < kP / 16; ++pr) {
                    uint32_t bb[4];
                    ldsm_x4(bb, s_lane + (16 * pr * PN + 16 * kk) * E);
                    mma_pair<T>(y[2 * pr], y[2 * pr + 1], a, bb);
                }
            }
            const int t_lo = 16 * rb + lane / 4, t_hi = t_lo + 8;
            const float e_lo = sc.ecum[t_lo], e_hi = sc.ecum[t_hi];
            auto cum_of = [&](int t) {
                const float4 v = sc.cd[t / 2];
                return t & 1 ? v.z : v.x;
            };
            const float cum_t[2] = {cum_of(t_lo), cum_of(t_hi)};
#pragma unroll
            for (int j = 0; j < kP / 8; ++j) {
                y[j][0] *= e_lo;
                y[j][1] *= e_lo;
                y[j][2] *= e_hi;
                y[j][3] *= e_hi;
            }
            // Mask and decay C B^T, then y += M x, the accumulators turned into A fragments in place.
            const uint32_t x_lane = xs + (bt_rows * PX + bt_cols) * E;
#pragma unroll
            for (int kk = 0; kk < kQ / 16; ++kk) {
                if (kk > rb) break;
                uint32_t a[4];
                masked_decay_frag<T>(a, *reinterpret_cast<const float(*)[2][4]>(gm[2 * kk]), sc, t_lo, cum_t, 16 * kk, kk < rb);
#pragma unroll
                for (int pr = 0; pr < kP / 16; ++pr) {
                    uint32_t bb[4];
                    ldsm_x4_trans(bb, x_lane + (16 * kk * PX + 16 * pr) * E);
                    mma_pair<T>(y[2 * pr], y[2 * pr + 1], a, bb);
                }
            }
            // y += D x, gate, store.
            const T* z = GATED ? static_cast<const T*>(p.z) : nullptr;
            T* out = static_cast<T*>(p.y);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = half ? t_hi : t_lo;
                const int64_t t = t0 + row;
                if (!win.inside(row)) continue;
                const int col0 = 2 * (lane % 4);
                const int64_t base = ((b * p.seqlen + t) * p.heads + h) * kP + col0;
#pragma unroll
                for (int j = 0; j < kP / 8; ++j) {
                    const float2 xv = O::unpack2(*reinterpret_cast<const T2*>(&sm.x[buf][row * PX + col0 + 8 * j]));
                    float v0 = y[j][2 * half] + dskip[j][0] * xv.x;
                    float v1 = y[j][2 * half + 1] + dskip[j][1] * xv.y;
                    if (GATED) {
                        const float2 zv = O::unpack2(*reinterpret_cast<const T2*>(z + base + 8 * j));
                        v0 *= silu_fast(zv.x);  // exact expf and division: 637 us instead of 538
                        v1 *= silu_fast(zv.y);
                    }
                    *reinterpret_cast<T2*>(out + base + 8 * j) = O::pack2(v0, v1);
                }
            }
        }

        // S <- 2^cum_last S + (w o x)^T B; w scales the k (= step) pairs of the A fragments.
        const float decay = ex2_ftz(cum_last);
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] *= decay;
        const uint32_t xt_lane = xs + (at_rows * PX + 16 * rb + at_cols) * E;
        const uint32_t bt_lane = bs + (bt_rows * PN + bt_cols) * E;
#pragma unroll
        for (int kk = 0; kk < kQ / 16; ++kk) {
            uint32_t a[4];
            ldsm_x4_trans(a, xt_lane + 16 * kk * PX * E);
            scale_a_cols<T>(a, sc.w[8 * kk + lane % 4], sc.w[8 * kk + 4 + lane % 4]);
#pragma unroll
            for (int pr = 0; pr < N / 16; ++pr) {
                uint32_t bb[4];
                ldsm_x4_trans(bb, bt_lane + (16 * kk * PN + 16 * pr) * E);
                mma_pair<T>(s[2 * pr], s[2 * pr + 1], a, bb);
            }
        }
        if (warp == 0 && win.has_next()) {
            tile_scalars(sm.sc[buf ^ 1], p, dt_bias, a_log2, win.next_start(), dt_raw, true, win.next_stop());
            load_dt<T>(p, b, h, win.later_start(), dt_raw);
        }
        __syncthreads();
    }

    store_part_state<N, LOCAL, PACKED>(s, p, rec, bh, part, int(split.n_parts), decay_sum);
}

}  // namespace ssd_mma
