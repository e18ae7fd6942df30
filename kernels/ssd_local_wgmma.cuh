// The SSD sequence split's first passes on Hopper's wgmma (sm_90a, dstate 128): the forward's
// (ssd_fwd.cu) and the backward's (ssd_bwd.cu). A block sums one piece of the sequence of one
// (batch, head) from nothing coming in, with cum_t the running sum of dt * A through step t (log2):
//   forward:  S  = sum_s 2^(cum_end - cum_s) dt_s x_s^T B_s    (the state leaving the piece)
//   backward: dS = sum_t 2^(cum_t - cum_begin) dy_t^T C_t      (the gradient of the state entering it)
// and records it with the piece's total decay. Either is one long product u^T (weights o v), with no
// recurrence: each tile's product is scaled by the decay of the tiles between it and the piece's far
// end, which the loop has seen when the tiles run from that end (forward: last to first), so that the
// scale is a running sum of tile totals (no difference of two long sums to round). The products of
// consecutive tiles overlap, both operands in shared memory, u scaled in place.
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

// The rows of a (kQ x kP) tile scaled in place by w[row] * scale: thread t takes 16-byte chunk t % 8
// of rows t / 8 + 16k (a quarter warp covers a row: no bank conflicts; the swizzle moves chunks
// within their row only).
template <typename T> __device__ __forceinline__ void scale_tile_rows(T* tile, const float* w, float scale) {
    using O = Ops<T>;
    const int tid = threadIdx.x;
#pragma unroll
    for (int k = 0; k < kQ / 16; ++k) {
        const int row = tid / 8 + 16 * k;
        const float f = w[row] * scale;
        uint4* at = reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(tile) + row * 128 + (tid % 8) * 16);
        uint4 v = *at;
        uint32_t* e = &v.x;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const float2 x = O::unpack2(*reinterpret_cast<const typename O::T2*>(&e[r]));
            e[r] = pack_u32<T>(x.x * f, x.y * f);
        }
        *at = v;
    }
}

// The sum over tiles [tile_begin, tile_end) of (b, h, g), u and v (batch, seqlen, heads, kP) and
// (batch, seqlen, groups, N) arrays; SUFFIX: the forward's weights 2^(cum_last - cum_s) dt_s within a
// tile, tiles last to first; else the backward's 2^cum_t, first to last. Writes the (kP x N) sum to
// `record` (f32, row-major) and the total decay to *record_decay.
template <typename T, int N, bool SUFFIX>
__device__ __forceinline__ void local_sum_wgmma(const SsdParams& p, int64_t b, int64_t h, int64_t g, const void* u,
                                                const void* v, int64_t tile_begin, int64_t tile_end, float* record,
                                                float* record_decay) {
    static_assert(N == 128, "the first passes on wgmma take dstate 128");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    LocalSmem<T, N>& sm = *reinterpret_cast<LocalSmem<T, N>*>(wgmma::align_1024(smem_raw));
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t n_tiles = max(tile_end - tile_begin, int64_t(0));
    // Loop step i's first step; past the piece, the sequence's end (all padding: dt 0).
    auto t0_of = [&](int64_t i) {
        if (i >= n_tiles) return p.seqlen;
        return (SUFFIX ? tile_end - 1 - i : tile_begin + i) * kQ;
    };
    const float a_log2 = p.A[h] * kLog2e;

    const TileLoads<T, N> loads(p, b, h, g, u, v, nullptr);
    auto load = [&](int64_t i) {
        const int stage = int(i % kLocalStages);
        if (i < n_tiles) loads.template issue<false>(t0_of(i), sm.u[stage], sm.v[stage], nullptr, wgmma::tile_byte, wgmma::tile_byte);
        cp_async_commit();
    };
    // This warp's tile of a batch: its weights from its dt, which was loaded a batch before.
    float dt_raw[2];
    auto form_weights = [&](int64_t i) {
        const TileCum c(p, h, a_log2, t0_of(i), dt_raw);
        LocalWeights& out = sm.wt[(i / kLocalBatch) & 1][i % kLocalBatch];
        float w[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) w[e] = SUFFIX ? ex2_ftz(c.last - c.cum[e]) * c.dt[e] : ex2_ftz(c.cum[e]);
        *reinterpret_cast<float2*>(&out.w[2 * lane]) = make_float2(w[0], w[1]);
        if (lane == 0) out.total = c.last;
        load_dt<T>(p, b, h, t0_of(i + kLocalBatch), dt_raw);
    };
    load_dt<T>(p, b, h, t0_of(warp), dt_raw);
    form_weights(warp);
    load(0);
    load(1);

    float s[N / 8][4] = {};
    float decay_sum = 0.f;  // of the tiles before step i's in the loop's order
    for (int64_t i = 0; i < n_tiles; ++i) {
        const int stage = int(i % kLocalStages);
        cp_async_wait_group<1>();  // tile i landed
        __syncthreads();           // and every warp is past step i - 1's wait: tile i - 2's stage is free
        load(i + 2);
        if (i % kLocalBatch == 0) form_weights(i + kLocalBatch + warp);  // read from step i + kLocalBatch on
        const LocalWeights& wt = sm.wt[(i / kLocalBatch) & 1][i % kLocalBatch];
        scale_tile_rows<T>(sm.u[stage], wt.w, ex2_ftz(decay_sum));
        decay_sum += wt.total;
        wgmma::fence_shared_to_async();
        __syncthreads();
        wgmma::fence();
        const uint64_t u_desc = wgmma::desc(smem_addr(sm.u[stage]), wgmma::kLbo, wgmma::kSbo),
                       v_desc = wgmma::desc(smem_addr(sm.v[stage]), wgmma::kLbo, wgmma::kSbo);
#pragma unroll
        for (int kk = 0; kk < kQ / 16; ++kk) {
            const uint32_t k_at = kk * 16 * 128 / 16;  // 16 rows (steps) on, in descriptor units
            wgmma::Ops<T>::ss_mn_n128(s, u_desc + k_at, v_desc + k_at);
        }
        wgmma::commit();
        wgmma::wait<1>();
    }
    wgmma::wait<0>();
    wgmma::pin(s);
    for_state_pairs<N>(s, [&](float* acc, int row, int col) {
        *reinterpret_cast<float2*>(record + row * N + col) = make_float2(acc[0], acc[1]);
    });
    if (tid == 0) *record_decay = decay_sum;
}

}  // namespace ssd_mma
