// The SSD sequence split's first passes on Hopper's wgmma (sm_90a, dstate 128): the forward's
// (ssd_fwd.cu) and the backward's (ssd_bwd.cu). A block sums one piece of the sequence of one
// (batch, head) from nothing coming in, with cum_t the running sum of dt * A through step t (log2):
//   forward:  S  = sum_s 2^(cum_end - cum_s) dt_s x_s^T B_s    (the state leaving the piece)
//   backward: dS = sum_t 2^(cum_t - cum_begin) dy_t^T C_t      (the gradient of the state entering it)
// and records it with the piece's total decay. Either is one long product u^T (weights o v), with no
// recurrence: each tile's product is scaled by the decay of the tiles between it and the piece's far
// end, which the loop has seen when the tiles run from that end (forward: last to first), so that the
// scale is a running sum of tile totals (no difference of two long sums to round). u^T enters the
// products as register fragments scaled on their way from shared memory (scaling u in place there took
// a store, a proxy fence and a barrier per tile), v from shared memory; a tile's fragments are
// prepared while the tile before's product runs.
//
// Its speed is in latencies: the recurrence these passes replaced (a tile's decay of S, dt loaded one
// tile ahead) took ~1.9 us a tile at 9% occupancy on an H200. Here the copies run two tiles ahead, and
// the warps form the next four tiles' weights together from dt loaded four tiles before. (Pulling
// the rows of tiles four or eight further on into L2 made both passes slower.)
#pragma once
#include "ssd_fwd_common.cuh"
#include "wgmma.cuh"

namespace ssd_mma {

constexpr int kLocalStages = 4;  // copies two tiles ahead; one stage is read by the product in flight
constexpr int kLocalBatch = 4;   // tiles whose weights the four warps form at once, one each

// A tile's per-step weights and its total decay (log2).
struct alignas(16) LocalWeights {  // w is written as float2 pairs
    float w[kQ];
    float total;
};

template <typename T, int N> struct LocalSmem {
    T u[kLocalStages][kQ * kP];  // wgmma::tile_byte layout, each 1024-byte aligned
    T v[kLocalStages][kQ * N];
    LocalWeights wt[2][kLocalBatch];  // the batch of tiles being summed and the next
};
// Dynamic shared memory of a first-pass block: the tiles plus slack to align them to 1024 bytes.
template <typename T, int N> __host__ __device__ constexpr int local_shared_bytes() { return int(sizeof(LocalSmem<T, N>)) + 1024; }

// The sum over tiles [tile_begin, tile_end) of (b, h, g), u and v (batch, seqlen, heads, kP) and
// (batch, seqlen, groups, N) arrays; SUFFIX: the forward's weights 2^(cum_last - cum_s) dt_s within a
// tile, tiles last to first; else the backward's 2^cum_t, first to last. Writes the (kP x N) sum to
// `record` (f32, row-major) and the total decay to *record_decay.
//
// Packed sequences, PACKED (the forward; a packed backward's decays carry cuts instead, TileCum): a
// piece in which a sequence starts sums only from the last such start on, adds that sequence's
// initial state decayed through the piece, and records the decay as -inf (nothing before the start
// passes through).
template <typename T, int N, bool SUFFIX, bool PACKED = false>
__device__ __forceinline__ void local_sum_wgmma(const SsdParams& p, int64_t b, int64_t h, int64_t g, const void* u,
                                                const void* v, int64_t tile_begin, int64_t tile_end, float* record,
                                                float* record_decay) {
    static_assert(N == 128, "the first passes on wgmma take dstate 128");
    static_assert(SUFFIX || !PACKED, "a packed backward comes as cuts in its decays (TileCum), not windows");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    LocalSmem<T, N>& sm = *reinterpret_cast<LocalSmem<T, N>*>(wgmma::align_1024(smem_raw));
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // A packed forward's last sequence start in the piece: sum from `from` on, then add initial_states[restart].
    int64_t from = 0, restart = -1;
    if constexpr (PACKED) {
        const int64_t piece_end = min(tile_end * kQ, p.seqlen);
        const Windows win(p, piece_end);
        const int64_t k = win.k - 1;  // the last sequence starting before piece_end
        if (tile_begin < tile_end && k >= 0 && win.boundary(k) >= tile_begin * kQ) {
            from = win.boundary(k);
            restart = k;
            tile_begin = from / kQ;
        }
    }
    const int64_t n_tiles = max(tile_end - tile_begin, int64_t(0));
    // Loop step i's first step; past the piece, the sequence's end (all padding: dt 0).
    auto t0_of = [&](int64_t i) {
        if (i >= n_tiles) return p.seqlen;
        return (SUFFIX ? tile_end - 1 - i : tile_begin + i) * kQ;
    };
    const float a_log2 = p.A[h] * kLog2e, dt_bias = ssd_dt_bias(p, h);

    const TileLoads<T, N> loads(p, b, h, g, u, v, nullptr);
    auto load = [&](int64_t i) {
        const int stage = int(i % kLocalStages);
        if (i < n_tiles) loads.template issue<false>(t0_of(i), sm.u[stage], sm.v[stage], nullptr, wgmma::tile_byte, wgmma::tile_byte);
        cp_async_commit();
    };
    // This warp's tile of a batch: its weights from its dt, which was loaded a batch before.
    T dt_raw[2];
    auto form_weights = [&](int64_t i) {
        const TileCum c(p, dt_bias, a_log2, t0_of(i), dt_raw, PACKED ? from : 0, p.seqlen, !SUFFIX);
        LocalWeights& out = sm.wt[(i / kLocalBatch) & 1][i % kLocalBatch];
        float w[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) w[e] = SUFFIX ? ex2_ftz(c.last - c.cum[e]) * c.dt[e] : ex2_ftz(c.cum[e]);
        *reinterpret_cast<float2*>(&out.w[2 * lane]) = make_float2(w[0], w[1]);
        if (lane == 0) out.total = c.last;
        load_dt<T>(p, b, h, t0_of(i + kLocalBatch), dt_raw);
    };
    load(0);  // first: the copies' latency then passes while the first weights wait for A and dt
    load(1);
    load_dt<T>(p, b, h, t0_of(warp), dt_raw);
    form_weights(warp);

    // u^T's A fragments (rows p = headdim, k = steps) of a tile, scaled by its steps' weights times
    // 2^(the decay of the tiles before it in the loop's order): ldmatrix.trans of u's rows as the
    // forward's state update takes x's (warp w: rows 16w..16w+15).
    const int at_row = (lane & 7) + (lane >> 4) * 8, at_col = 16 * warp + ((lane >> 3) & 1) * 8;
    float s[N / 8][4] = {};
    float decay_sum = 0.f;  // of the tiles before step i's in the loop's order
    // Step i: prepares tile i's fragments in `mine` while tile i - 1's product (from `other`) runs,
    // then issues tile i's.
    auto step = [&](int64_t i, uint32_t(&mine)[kQ / 16][4], uint32_t(&other)[kQ / 16][4]) {
        const int stage = int(i % kLocalStages);
        cp_async_wait_group<1>();          // tile i landed
        wgmma::fence_shared_to_async();    // (B's copy is read by the product)
        __syncthreads();                   // and every warp is past step i - 1's wait: tile i - 2's stage is free
        load(i + 2);
        if (i % kLocalBatch == 0) form_weights(i + kLocalBatch + warp);  // read from step i + kLocalBatch on
        const LocalWeights& wt = sm.wt[(i / kLocalBatch) & 1][i % kLocalBatch];
        const float scale = ex2_ftz(decay_sum);
        decay_sum += wt.total;
        const uint32_t u_tile = smem_addr(sm.u[stage]);
#pragma unroll
        for (int kk = 0; kk < kQ / 16; ++kk) {
            ldsm_x4_trans(mine[kk], u_tile + wgmma::swizzled(16 * kk + at_row, at_col));
            const float2 lo = *reinterpret_cast<const float2*>(&wt.w[16 * kk + 2 * (lane % 4)]);
            const float2 hi = *reinterpret_cast<const float2*>(&wt.w[16 * kk + 8 + 2 * (lane % 4)]);
            scale_a_cols<T>(mine[kk], make_float2(lo.x * scale, lo.y * scale), make_float2(hi.x * scale, hi.y * scale));
        }
        wgmma::wait<0>();  // tile i - 1's product: `other` is free from here
#pragma unroll
        for (int kk = 0; kk < kQ / 16; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(other[kk][r])::"memory");
        wgmma::fence();
        const uint64_t v_desc = wgmma::desc(smem_addr(sm.v[stage]), wgmma::kLbo, wgmma::kSbo);  // N-major
#pragma unroll
        for (int kk = 0; kk < kQ / 16; ++kk) wgmma::Ops<T>::rs_n128(s, mine[kk], v_desc + kk * 16 * 128 / 16);
        wgmma::commit();
    };
    uint32_t frag[2][kQ / 16][4];
    int64_t i = 0;
    for (; i + 1 < n_tiles; i += 2) {
        step(i, frag[0], frag[1]);
        step(i + 1, frag[1], frag[0]);
    }
    if (i < n_tiles) step(i, frag[0], frag[1]);
    wgmma::wait<0>();
    wgmma::pin(s);
#pragma unroll
    for (int kk = 0; kk < kQ / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(frag[0][kk][r]), "+r"(frag[1][kk][r])::"memory");
    const float* initial = PACKED && restart >= 0 && restart < p.num_seqs && p.initial_states
                               ? p.initial_states + (restart * p.heads + h) * int64_t(kP) * N
                               : nullptr;
    const float carried = ex2_ftz(decay_sum);  // the initial state's decay through the rest of the piece
    for_state_pairs<N>(s, [&](float* acc, int row, int col) {
        float2 v = make_float2(acc[0], acc[1]);
        if (initial) {
            const float2 s0 = *reinterpret_cast<const float2*>(initial + row * N + col);
            v = make_float2(fmaf(carried, s0.x, v.x), fmaf(carried, s0.y, v.y));
        }
        *reinterpret_cast<float2*>(record + row * N + col) = v;
    });
    if (tid == 0) *record_decay = PACKED && restart >= 0 ? -INFINITY : decay_sum;
}

}  // namespace ssd_mma
