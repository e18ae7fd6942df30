// Building blocks of the SSD tensor-core kernels (ssd_fwd.cu, ssd_bwd.cu): bf16/f16 mma.sync m16n8k16
// with f32 accumulators, ldmatrix from padded shared tiles, cp.async, and a tile's per-step scalars.
#pragma once
#include "ssd.cuh"

namespace ssd_mma {

constexpr int kQ = 64;  // steps per tile
constexpr int kP = 64;  // headdim
// 4 warps; warp w owns rows 16w..16w+15 of the state (and of the step-major products). 8 warps of
// half the columns each measured 10-20% slower in the forward (H100).
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;

template <typename T> struct Ops;
template <> struct Ops<bf16> {
    using T2 = __nv_bfloat162;
    static __device__ __forceinline__ T2 pack2(float lo, float hi) { return __floats2bfloat162_rn(lo, hi); }
    static __device__ __forceinline__ float2 unpack2(T2 v) { return __bfloat1622float2(v); }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct Ops<f16> {
    using T2 = __half2;
    static __device__ __forceinline__ T2 pack2(float lo, float hi) { return __floats2half2_rn(lo, hi); }
    static __device__ __forceinline__ float2 unpack2(T2 v) { return __half22float2(v); }
    static __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// lo += a * (bb[0], bb[1]); hi += a * (bb[2], bb[3]): the two n-tiles one x4 ldmatrix loads.
template <typename T>
__device__ __forceinline__ void mma_pair(float* lo, float* hi, const uint32_t a[4], const uint32_t bb[4]) {
    Ops<T>::mma(lo, a, bb[0], bb[1]);
    Ops<T>::mma(hi, a, bb[2], bb[3]);
}

template <typename T> __device__ __forceinline__ uint32_t pack_u32(float lo, float hi) {
    typename Ops<T>::T2 v = Ops<T>::pack2(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Tiles are row-major with rows padded by 16 bytes: the 8 row addresses of an ldmatrix then start 4
// banks apart (conflict-free), and each lane's addresses are a fixed base plus compile-time offsets.
template <int COLS> __host__ __device__ constexpr int pitch() { return COLS + 8; }

// Per-step scalars of a tile, from dt.
struct TileScalars {
    float4 cd[kQ / 2];  // {cum_t, dt_t, cum_t+1, dt_t+1}: cum = running sum of dt * A * log2(e)
    float2 w[kQ / 2];   // 2^(cum_last - cum_t) dt_t: the state update's weights
    float ecum[kQ];     // 2^cum_t (also read as float2 pairs)
};
static_assert(offsetof(TileScalars, ecum) % alignof(float2) == 0, "ecum is read as float2 pairs");

// The thread's share of a (kP x N) f32 state held as mma accumulators: rows 16w + lane/4 (+8),
// columns 8j + 2(lane%4) (+1). `f(acc_pair, row, col)` visits each adjacent pair.
template <int N, typename F> __device__ __forceinline__ void for_state_pairs(float (&s)[N / 8][4], F f) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = 16 * warp + lane / 4, col = 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        f(&s[j][0], row, 8 * j + col);
        f(&s[j][2], row + 8, 8 * j + col);
    }
}

// The same state stored to T rows (row r at base + r * row_stride, 8-byte aligned) in whole 32-byte
// sectors: lane pairs swap one T pair, so that each thread stores 4 adjacent elements and a quad
// covers 16 (two n-tiles) of a row in one instruction. Even lanes store columns 8j + 2q .. +3
// (q = lane % 4), odd lanes 8j + 8 + 2(q - 1) .. +3. (Each thread storing its own pairs, 4 bytes
// apart from its partner's, writes as many L2 sectors as f32 and measured no faster than f32.)
template <typename T, int N>
__device__ __forceinline__ void store_state_t(float (&s)[N / 8][4], T* base, int64_t row_stride) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool odd = lane & 1;
    const int row = 16 * warp + lane / 4, col = 2 * (lane % 4) + (odd ? 6 : 0);
#pragma unroll
    for (int j = 0; j < N / 8; j += 2) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // rows row, row + 8
            const uint32_t a = pack_u32<T>(s[j][2 * half], s[j][2 * half + 1]);
            const uint32_t b = pack_u32<T>(s[j + 1][2 * half], s[j + 1][2 * half + 1]);
            const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? a : b, 1);
            *reinterpret_cast<uint2*>(base + (row + 8 * half) * row_stride + 8 * j + col) =
                odd ? make_uint2(got, b) : make_uint2(a, got);
        }
    }
}

// acc <- 2^decay_r acc + state_r for the split's records r = first, first + step, ... (count of them,
// in that order), records laid out [record][batch * heads]: the (kP x N) f32 state of record r at
// states + r * per_record kP N, its decay (log2) at decays[r * per_record].
template <int N>
__device__ __forceinline__ void fold_records(float (&acc)[N / 8][4], const float* states, const float* decays,
                                             int64_t per_record, int64_t first, int64_t count, int64_t step) {
    for (int64_t i = 0, r = first; i < count; ++i, r += step) {
        const float decay = exp2f(decays[r * per_record]);
        const float* src = states + r * per_record * kP * N;
        for_state_pairs<N>(acc, [&](float* out, int row, int col) {
            const float2 v = *reinterpret_cast<const float2*>(src + row * N + col);
            out[0] = fmaf(decay, out[0], v.x);
            out[1] = fmaf(decay, out[1], v.y);
        });
    }
}

// The sequence split's first passes cut a part (tiles_per_part tiles of a sequence of n_tiles) in
// `pieces` pieces of whole tiles, the last ones shorter or empty: the tiles [begin, end) of one.
__device__ __forceinline__ void piece_tiles(int64_t tiles_per_part, int64_t pieces, int64_t part, int64_t piece,
                                            int64_t n_tiles, int64_t& begin, int64_t& end) {
    const int64_t per_piece = (tiles_per_part + pieces - 1) / pieces;
    begin = part * tiles_per_part + piece * per_piece;
    end = min(min(begin + per_piece, (part + 1) * tiles_per_part), n_tiles);
}

// Where this thread's cp.async chunks of a tile with COLS-element rows go: rows row0 + k * kRowStep.
template <int COLS> struct TileCopy {
    static constexpr int kChunksPerRow = COLS / 8;
    static constexpr int kRowStep = kThreads / kChunksPerRow;
    static constexpr int kPasses = kQ / kRowStep;
    int row0, col;
    __device__ TileCopy() : row0(threadIdx.x / kChunksPerRow), col((threadIdx.x % kChunksPerRow) * 8) {}
};

// Rows of the tile starting at step t0 that lie inside the sequence (0..kQ): copies check their row
// against it in 32 bits.
__device__ __forceinline__ int tile_rows(int64_t seqlen, int64_t t0) {
    return int(max(min(seqlen - t0, int64_t(kQ)), int64_t(0)));
}

// dt of steps t0 + 2 lane (+1) of (b, h), 0 past the end, as stored (T): converted where it is used,
// a load issued a tile ahead is waited for there. (Converted here, each tile waited for its next
// tile's dt right after issuing the load: ~7% of the forward's stall samples.)
template <typename T>
__device__ __forceinline__ void load_dt(const SsdParams& p, int64_t b, int64_t h, int64_t t0, T (&raw)[2]) {
    const T* dt = static_cast<const T*>(p.dt);
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int64_t t = t0 + 2 * lane + e;
        raw[e] = from_f32<T>(0.f);
        if (t < p.seqlen) raw[e] = dt[(b * p.seqlen + t) * p.heads + h];
    }
}
// The same, converted to f32 at once (for a use right after the load).
template <typename T>
__device__ __forceinline__ void load_dt_f32(const SsdParams& p, int64_t b, int64_t h, int64_t t0, float (&raw)[2]) {
    T stored[2];
    load_dt<T>(p, b, h, t0, stored);
#pragma unroll
    for (int e = 0; e < 2; ++e) raw[e] = to_f32(stored[e]);
}

// Boundary s of a packed call (cu_seqlens[s]), clamped to [0, seqlen]: the CUDA target cannot check
// the boundaries, so invalid ones must still index only inside the buffers.
__device__ __forceinline__ int64_t clamped_boundary(const int32_t* cu, int64_t seqlen, int64_t s) {
    return min(max(int64_t(cu[s]), int64_t(0)), seqlen);
}
// The first s in [lo, hi) whose clamped boundary is at least t, hi if none (the boundaries taken as
// sorted: invalid ones still end the search inside [lo, hi)).
__device__ __forceinline__ int64_t first_boundary_at_or_after(const int32_t* cu, int64_t seqlen, int64_t t, int64_t lo,
                                                              int64_t hi) {
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (clamped_boundary(cu, seqlen, mid) < t) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// The packed backward's cut (docs/ssd.md, "Packed sequences"): a log2 decay added at the first step
// of every sequence but the first, so that 2^(cum_t - cum_s) underflows to exactly 0 across it and
// nothing before a boundary reaches past it. Large enough to zero any decay a tile or chunk holds
// on the far side; small enough that cum keeps ~2^-14 absolute precision past a few of them.
constexpr float kBoundaryCut = -512.f;
// kBoundaryCut when step t (0 < t < seqlen) starts a packed sequence, else 0: a search of the
// boundaries cu_seqlens[1..num_seqs-1], clamped as the forward's windows take them.
__device__ __forceinline__ float boundary_cut(const SsdParams& p, int64_t t) {
    const int64_t k = first_boundary_at_or_after(p.cu_seqlens, p.seqlen, t, 1, p.num_seqs);
    return t > 0 && t < p.seqlen && k < p.num_seqs && clamped_boundary(p.cu_seqlens, p.seqlen, k) == t ? kBoundaryCut
                                                                                                        : 0.f;
}

// One warp's running sum of dt * A (log2 units) through a tile from its raw dt (load_dt: T, or f32):
// lane l owns steps 2l and 2l + 1, with dt after bias/softplus/clamp (0 outside the steps [lo, hi),
// by default the sequence: such steps neither decay nor add), cum[e] the sum through step 2l + e,
// `last` the tile's total. (A packed forward's windows end at sequence boundaries: ssd_fwd_common.cuh.
// A packed backward, `cut`, adds boundary_cut at their first steps.)
struct TileCum {
    float dt[2], cum[2], last;
    template <typename R>
    __device__ __forceinline__ TileCum(const SsdParams& p, float dt_bias, float a_log2, int64_t t0, const R (&raw)[2])
        : TileCum(p, dt_bias, a_log2, t0, raw, 0, p.seqlen) {}
    template <typename R>
    __device__ __forceinline__ TileCum(const SsdParams& p, float dt_bias, float a_log2, int64_t t0, const R (&raw)[2],
                                       int64_t lo, int64_t hi, bool cut = false) {
        const int lane = threadIdx.x & 31;
        float a[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int64_t t = t0 + 2 * lane + e;
            dt[e] = t >= lo && t < hi ? ssd_dt(p, to_f32(raw[e]), dt_bias) : 0.f;
            a[e] = dt[e] * a_log2;
            if (cut && p.cu_seqlens) a[e] += boundary_cut(p, t);
        }
        float run = a[0] + a[1];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float other = __shfl_up_sync(0xffffffffu, run, o);
            if (lane >= o) run += other;
        }
        cum[0] = run - a[1];
        cum[1] = run;
        last = __shfl_sync(0xffffffffu, run, 31);
    }
};

// One warp turns the raw dt of a tile into its scalars, stored when `store`; steps from `end` on (by
// default the sequence's end) are padding; `cut`: the packed backward's (TileCum).
template <typename R>
__device__ __forceinline__ void tile_scalars(TileScalars& out, const SsdParams& p, float dt_bias, float a_log2,
                                             int64_t t0, const R (&raw)[2], bool store = true, int64_t end = -1,
                                             bool cut = false) {
    const int lane = threadIdx.x & 31;
    const TileCum c(p, dt_bias, a_log2, t0, raw, 0, end < 0 ? p.seqlen : end, cut);
    if (!store) return;
    const float c0 = c.cum[0], c1 = c.cum[1];
    out.cd[lane] = make_float4(c0, c.dt[0], c1, c.dt[1]);
    out.w[lane] = make_float2(ex2_ftz(c.last - c0) * c.dt[0], ex2_ftz(c.last - c1) * c.dt[1]);
    out.ecum[2 * lane] = ex2_ftz(c0);
    out.ecum[2 * lane + 1] = ex2_ftz(c1);
}

// Scales the k pairs (2(lane%4) (+1) and +8) of an A fragment.
template <typename T> __device__ __forceinline__ void scale_a_cols(uint32_t a[4], float2 lo, float2 hi) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const float2 v = Ops<T>::unpack2(*reinterpret_cast<const typename Ops<T>::T2*>(&a[r]));
        const float2 f = r < 2 ? lo : hi;
        a[r] = pack_u32<T>(v.x * f.x, v.y * f.y);
    }
}

// The A fragment (k = s) of a masked, decayed 16 x 16 block of G = (C B^T) o M from its two n-tiles of
// accumulators: M[t, s] = 2^(cum_t - cum_s) dt_s for s <= t, else 0. Rows t_lo = 16 rb + lane/4 and
// t_lo + 8 with cum_t[2]; the block's steps start at s_block; `below`: the block is left of the
// diagonal (s < t throughout).
template <typename T>
__device__ __forceinline__ void masked_decay_frag(uint32_t a[4], const float (&acc)[2][4], const TileScalars& sc, int t_lo,
                                                  const float (&cum_t)[2], int s_block, bool below) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int s0 = s_block + 8 * half + 2 * (lane % 4);
        const float4 cd = sc.cd[s0 / 2];  // {cum, dt} of s0 and s0 + 1
        float m[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int t = e < 2 ? t_lo : t_lo + 8, sidx = s0 + (e & 1);
            const float cum_s = e & 1 ? cd.z : cd.x, dt_s = e & 1 ? cd.w : cd.y;
            const float v = acc[half][e] * ex2_ftz(cum_t[e >> 1] - cum_s) * dt_s;
            m[e] = below || sidx <= t ? v : 0.f;
        }
        a[2 * half] = pack_u32<T>(m[0], m[1]);
        a[2 * half + 1] = pack_u32<T>(m[2], m[3]);
    }
}

// D of the columns 8j + 2(lane%4) (+1) of a row block (mma accumulator layout, P = headdim).
__device__ __forceinline__ void load_dskip(float (&dskip)[kP / 8][2], const SsdParams& p, int64_t h) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < kP / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int col = 8 * j + 2 * (lane % 4) + e;
            dskip[j][e] = p.D ? p.D[p.D_per_channel ? h * kP + col : h] : 0.f;
        }
}

}  // namespace ssd_mma
