// The SSD forward on Hopper's wgmma (sm_90a; ssd_fwd.cu takes ssd_fwd_sync.cuh elsewhere).
//
// One block of 128 threads (one warpgroup) scans one (batch, head) through the sequence in tiles of 64
// steps, the state S (headdim x dstate, f32) living in the warpgroup's accumulators (warp w: rows
// p = 16w..16w+15). Per tile, with cum_t the running sum of dt * A inside the tile (log2 units):
//   y  = diag(2^cum) C S^T  +  G x,   G = (C B^T) o M,   M[t, s] = 2^(cum_t - cum_s) dt_s for s <= t, else 0
//   S <- 2^cum_last S  +  (w o x)^T B,             w_s = 2^(cum_last - cum_s) dt_s
// The products are Hopper wgmma (kernels/wgmma.cuh): C B^T and C S^T with both operands in shared
// memory, G x and the state update with G / (w o x)^T in registers. The inputs stream through
// 128-byte-swizzled shared tiles by cp.async, one tile ahead; S goes to shared memory rounded to T
// once per tile (C S^T's operand). S and G enter the products rounded to T, as they take T operands.
// Unpacked, a tile's scalars (cum, dt, w, 2^cum) arrive with its inputs: a kernel ahead of this one
// (ssd_fwd_tile_scalars) parks them in y's rows of the tile, which the tile's y overwrites later.
#pragma once
#include "ssd_fwd_common.cuh"
#include "ssd_fwd_sync.cuh"  // SyncSmem: the launcher's shared-memory size
#include "wgmma.cuh"

namespace ssd_mma {

// Shared tiles of 64 rows, 128-byte swizzled in blocks of 64 columns (wgmma::tile_byte).
using wgmma::kBlockBytes;
using wgmma::kLbo;
using wgmma::kSbo;
using wgmma::tile_byte;
template <typename T, int N> struct WgSmem {
    T x[2][kQ * kP];
    T b[2][kQ * N];
    T c[2][kQ * N];
    T s[kP * N];       // the state entering the tile, rounded to T (C S^T's operand)
    TileScalars sc[2];  // of the tile in x/b/c[buf]
};
// Dynamic shared memory per block: the tiles plus slack to align them to 1024 bytes. The launcher
// gives every forward the mma.sync kernel's size, which is more.
template <typename T, int N> constexpr int wgmma_shared_bytes() { return int(sizeof(WgSmem<T, N>)) + 1024; }
static_assert(wgmma_shared_bytes<bf16, 128>() <= int(sizeof(SyncSmem<bf16, 128>)) &&
                  wgmma_shared_bytes<f16, 64>() <= int(sizeof(SyncSmem<f16, 64>)),
              "the launcher sizes shared memory for the mma.sync kernel");

// One tile's state update S <- 2^cum_last S + (w o x)^T B, in two steps: `prepare` decays S and loads
// (w o x)^T's A fragments (ldmatrix.trans of x's rows s = steps, scaled by w_s) before any product is
// issued, so that no instruction touches a register of an in-flight wgmma; `issue` issues and commits
// the products (B N-major in shared memory); `hold` keeps the fragments until the products are done.
template <typename T, int N> struct StateUpdate {
    uint32_t xa[kQ / 16][4];

    __device__ __forceinline__ void prepare(float (&s)[N / 8][4], uint32_t x_tile, const TileScalars& sc) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        // x rows 16 kk + at_row, columns 16 warp + at_col.
        const int at_row = (lane & 7) + (lane >> 4) * 8, at_col = 16 * warp + ((lane >> 3) & 1) * 8;
        const float decay = ex2_ftz(sc.cd[kQ / 2 - 1].z);
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] *= decay;
#pragma unroll
        for (int kk = 0; kk < kQ / 16; ++kk) {
            ldsm_x4_trans(xa[kk], x_tile + wgmma::swizzled(16 * kk + at_row, at_col));
            scale_a_cols<T>(xa[kk], sc.w[8 * kk + lane % 4], sc.w[8 * kk + 4 + lane % 4]);
        }
    }
    __device__ __forceinline__ void issue(float (&s)[N / 8][4], uint32_t b_tile) const {
        const uint64_t bn_desc = wgmma::desc(b_tile, kLbo, kSbo);
#pragma unroll
        for (int kk = 0; kk < kQ / 16; ++kk) {
            const uint64_t bd = bn_desc + kk * 16 * 128 / 16;
            if constexpr (N == 128) wgmma::Ops<T>::rs_n128(s, xa[kk], bd);
            else wgmma::Ops<T>::rs_n64(s, xa[kk], bd);
        }
        wgmma::commit();
    }
    __device__ __forceinline__ void hold() {
#pragma unroll
        for (int kk = 0; kk < kQ / 16; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(xa[kk][r])::"memory");
    }
};

// `scalars_in_y`: ssd_fwd_tile_scalars (kernels/ssd_fwd.cu) parked the scalars of every full tile in
// y's rows (unpacked only).
template <typename T, int N, bool GATED, bool PACKED>
__device__ __forceinline__ void ssd_fwd_wgmma(const SsdParams& p, const FwdSplit& split, bool scalars_in_y) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    WgSmem<T, N>& sm = *reinterpret_cast<WgSmem<T, N>*>(wgmma::align_1024(smem_raw));
    using O = Ops<T>;
    using W = wgmma::Ops<T>;
    using T2 = typename O::T2;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int rb = warp;  // row block of y and S
    const FwdBlock blk(p, split, std::false_type{});
    const int64_t bh = blk.bh, part = blk.part, b = blk.b, h = blk.h;
    const int64_t tile_begin = blk.tile_begin, tile_end = blk.tile_end;
    const float a_log2 = p.A[h] * kLog2e, dt_bias = ssd_dt_bias(p, h);
    const PartRecords rec = PartRecords::make<N>(p, split);

    // The state entering the part.
    float s[N / 8][4];
    load_part_state<N, false, PACKED>(s, p, rec, bh, part * split.records_per_part);
    float dskip[kP / 8][2];
    load_dskip(dskip, p, h);

    const TileLoads<T, N> loads(p, blk);
    // Scalars formed here are formed by every warp (a warp-0-only branch would serialize an in-flight
    // wgmma), each storing a quarter.
    const bool sc_store = (lane >> 3) == warp;
    // Unpacked, a tile's scalars come with its x, B and C: from y's first 8 rows of the tile, where
    // ssd_fwd_tile_scalars parked them, 16 bytes a thread (forming them here was ~13% of the kernel's
    // time at 8 x 2048 x 64 x 64 x 128), else (a last tile shorter than 64 steps) formed here.
    const T* sc_src = static_cast<const T*>(p.y) + ((b * p.seqlen + tid / 8) * p.heads + h) * kP + tid % 8 * 8;
    auto load_tile = [&](int buf, int64_t t0, int rows) {
        loads.template issue<true>(t0, rows, sm.x[buf], sm.b[buf], sm.c[buf], tile_byte, tile_byte);
        if constexpr (!PACKED) {
            if (scalars_in_y && rows == kQ) {
                if (tid < kQ)
                    cp_async16(reinterpret_cast<unsigned char*>(&sm.sc[buf]) + 16 * tid, sc_src + t0 * p.heads * kP, true);
            } else {
                T raw[2];
                load_dt<T>(p, b, h, t0, raw);
                tile_scalars(sm.sc[buf], p, dt_bias, a_log2, t0, raw, sc_store);
            }
        }
    };
    T* y_dst = static_cast<T*>(p.y) + loads.x_off;

    // The part's windows (its tiles; PACKED: cut at the sequences' boundaries).
    PartWindows<PACKED> win(p, tile_begin, tile_end);
    if (win.more()) load_tile(win.buf(), win.start(), win.rows());
    cp_async_commit();
    // PACKED: a window's scalars are formed one window ahead, while the one before runs its products.
    T dt_raw[2];
    if constexpr (PACKED) {
        load_dt<T>(p, b, h, win.start(), dt_raw);
        tile_scalars(sm.sc[win.buf()], p, dt_bias, a_log2, win.start(), dt_raw, sc_store, win.stop());
        load_dt<T>(p, b, h, win.next_start(), dt_raw);
    }
    auto next_scalars = [&](int buf) {
        if (PACKED && win.has_next()) {
            tile_scalars(sm.sc[buf ^ 1], p, dt_bias, a_log2, win.next_start(), dt_raw, sc_store, win.next_stop());
            load_dt<T>(p, b, h, win.later_start(), dt_raw);
        }
    };

    float gacc[kQ / 8][4] = {}, y[kP / 8][4] = {};  // overwritten by each window's first product
    for (; win.more(); win.advance()) {
        const int buf = win.buf();
        const int64_t t0 = win.start();
        // z is read straight from global memory by the epilogue: pull this window's rows (one line
        // each) into L2 now, half a tile before its use.
        if (GATED && tid < kQ && win.inside(tid))
            prefetch_l2(static_cast<const T*>(p.z) + ((b * p.seqlen + t0 + tid) * p.heads + h) * kP);
        if (win.has_next()) load_tile(buf ^ 1, win.next_start(), win.next_rows());
        cp_async_commit();
        cp_async_wait_one();
        store_chunk_state<T, N>(s, p, bh, t0);
        if constexpr (PACKED) reset_at<N>(s, p, win.starts, h, t0, true);
        for_state_pairs<N>(s, [&](float* acc, int row, int col) {
            *reinterpret_cast<uint32_t*>(reinterpret_cast<unsigned char*>(sm.s) + tile_byte(row, col)) =
                pack_u32<T>(acc[0], acc[1]);
        });
        wgmma::fence_shared_to_async();
        __syncthreads();

        const TileScalars& sc = sm.sc[buf];
        const uint32_t xs = smem_addr(sm.x[buf]), bs = smem_addr(sm.b[buf]), cs = smem_addr(sm.c[buf]);
        // The state update is prepared before any product is issued (S's copy in shared memory is
        // what C S^T reads) and runs while G is masked.
        StateUpdate<T, N> update;
        update.prepare(s, xs, sc);
        const uint64_t x_desc = wgmma::desc(xs, kLbo, kSbo);  // N-major
        wgmma::fence();
        uint32_t ga[kQ / 16][4];  // G's A fragments (k = s)
        // G = C B^T and C S^T, both operands K-major (k = state) in shared memory.
        const uint32_t ss = smem_addr(sm.s);
        const uint64_t c_desc = wgmma::desc(cs, 16, kSbo), b_desc = wgmma::desc(bs, 16, kSbo),
                       s_desc = wgmma::desc(ss, 16, kSbo);
#pragma unroll
        for (int kk = 0; kk < N / 16; ++kk) {
            const uint32_t k_at = ((kk / 4) * kBlockBytes + (kk % 4) * 32) >> 4;  // descriptor units
            W::ss_n64(gacc, c_desc + k_at, b_desc + k_at, kk > 0);
        }
#pragma unroll
        for (int kk = 0; kk < N / 16; ++kk) {
            const uint32_t k_at = ((kk / 4) * kBlockBytes + (kk % 4) * 32) >> 4;
            W::ss_n64(y, c_desc + k_at, s_desc + k_at, kk > 0);
        }
        wgmma::commit();
        update.issue(s, bs);
        next_scalars(buf);
        wgmma::wait<1>();  // G and C S^T done
        wgmma::pin(gacc);
        wgmma::pin(y);

        // Rows t = 16 rb + lane/4 (+8) of G and y, columns 8j + 2(lane%4) (+1).
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
        // Mask and decay G into A fragments (k = s). Every warp takes every block, also those right
        // of the diagonal (all zero): a branch here, with the state update in flight, would make
        // ptxas serialize the wgmma.
#pragma unroll
        for (int kk = 0; kk < kQ / 16; ++kk)
            masked_decay_frag<T>(ga[kk], *reinterpret_cast<const float(*)[2][4]>(gacc[2 * kk]), sc, t_lo, cum_t, 16 * kk, false);
        // y += G x: x N-major (n = headdim) in shared memory.
        wgmma::fence();
#pragma unroll
        for (int kk = 0; kk < kQ / 16; ++kk) W::rs_n64(y, ga[kk], x_desc + kk * 16 * 128 / 16);
        wgmma::commit();
        // PACKED: the gate's z of this thread's two rows, loaded while G x runs. (Unpacked, the
        // compiler hoists the epilogue's loads there itself; packed, it left them after the wait, one
        // at a time: 8 sequences in 1 x 16384 x 64 x 64 x 128 on an H200, forward 502-508 -> 443 us.)
        T2 z_pre[2][kP / 8];
        if constexpr (GATED && PACKED) {
            const T* z = static_cast<const T*>(p.z);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = t_lo + 8 * half;
                const T* z_row = z + ((b * p.seqlen + t0 + row) * p.heads + h) * kP + 2 * (lane % 4);
                const bool inside = win.inside(row);
#pragma unroll
                for (int j = 0; j < kP / 8; ++j)
                    z_pre[half][j] = inside ? *reinterpret_cast<const T2*>(z_row + 8 * j) : O::pack2(0.f, 0.f);
            }
        }

        // The epilogue's x pairs, read while G x runs (read after the wait, they held every warp there:
        // 13 us of the kernel's 202 at 8 x 2048 x 64 x 64 x 128 on an H200).
        T2 x_pre[2][kP / 8];
        {
            const unsigned char* xt = reinterpret_cast<const unsigned char*>(sm.x[buf]);
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int j = 0; j < kP / 8; ++j)
                    x_pre[half][j] = *reinterpret_cast<const T2*>(xt + tile_byte(t_lo + 8 * half, 2 * (lane % 4) + 8 * j));
        }
        wgmma::wait<0>();  // G x and the state update done
        wgmma::pin(y);
#pragma unroll
        for (int kk = 0; kk < kQ / 16; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(ga[kk][r])::"memory");  // read until here
        // y += D x (and the gate), written over the x tile: each thread overwrites exactly the x
        // elements it reads. After the barrier the tile leaves in 16-byte stores.
        const T* z = GATED ? static_cast<const T*>(p.z) : nullptr;
        unsigned char* xy = reinterpret_cast<unsigned char*>(sm.x[buf]);
        const int col0 = 2 * (lane % 4);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = t_lo + 8 * half;
            const int64_t t = t0 + row;
            const T* z_row = GATED ? z + ((b * p.seqlen + t) * p.heads + h) * kP + col0 : nullptr;
#pragma unroll
            for (int j = 0; j < kP / 8; ++j) {
                T2* at = reinterpret_cast<T2*>(xy + tile_byte(row, col0 + 8 * j));
                const float2 xv = O::unpack2(x_pre[half][j]);
                float v0 = y[j][2 * half] + dskip[j][0] * xv.x;
                float v1 = y[j][2 * half + 1] + dskip[j][1] * xv.y;
                // (PACKED: every row, without a branch; z_pre is 0 past the window, whose rows are
                // not stored. A branch per row made ptxas issue each silu alone.)
                if (GATED && (PACKED || win.inside(row))) {
                    const float2 zv = O::unpack2(PACKED ? z_pre[half][j] : *reinterpret_cast<const T2*>(z_row + 8 * j));
                    v0 *= silu_fast(zv.x);  // exact expf and division: 637 us instead of 538
                    v1 *= silu_fast(zv.y);
                }
                *at = O::pack2(v0, v1);
            }
        }
        wgmma::pin(s);
        update.hold();
        __syncthreads();
        // y out: the thread takes the chunks its next cp.async into this buffer overwrites, so no
        // other thread's copy can land before this read.
        const int rows = win.rows();
        T* y_row = y_dst + t0 * loads.x_step;
#pragma unroll
        for (int k = 0; k < TileCopy<kP>::kPasses; ++k) {
            const int row = loads.xcopy.row0 + k * TileCopy<kP>::kRowStep;
            if (row < rows)
                *reinterpret_cast<uint4*>(y_row) = *reinterpret_cast<const uint4*>(
                    reinterpret_cast<const unsigned char*>(sm.x[buf]) + tile_byte(row, loads.xcopy.col));
            y_row += TileCopy<kP>::kRowStep * loads.x_step;
        }
    }

    store_part_state<N, false, PACKED>(s, p, rec, bh, part, int(split.n_parts), 0.f);
}

}  // namespace ssd_mma
