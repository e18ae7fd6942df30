// Mamba-2 SSD backward on tensor cores (docs/ssd.md): bf16 / f16, headdim 64, dstate 64 or 128,
// chunk_size a multiple of 64. src/ops/ssd/cuda.rs takes it where it applies. The main kernel has no
// z: with z, gate_grad turns dy into the gradient of y before the gate first.
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
// and ddt / dA from the gradient of cum (see tile_dt_grads). Warp w computes the step-major products
// for rows s = 16w.. (columns t >= s) and t = 16w.. (columns s <= t). dB and dC go one of two ways
// (src/ops/ssd/plan.rs `mma_bwd_head_sums` picks per shape): per head into partials as large as B
// and C times the group's heads, which reduce_bc sums (PARTIALS: few heads per group); or not formed
// here at all: the main kernel stores each chunk's S and dS and the head-sum kernels below form dB
// and dC summed over the group's heads, a chunk at a time (that path's dx, S and dS leave through
// shared memory, copied out by warps 1-3 while warp 0 forms ddt). dA, ddt_bias and dD go to
// per-(batch, head) partials; the reduce kernels sum in a fixed order (no atomics: bitwise-repeatable).
#include "ssd_mma.cuh"
#include "wgmma.cuh"  // tile_byte: bc_sums' state tiles (its wgmma only on sm_90a)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "ssd_local_wgmma.cuh"
#endif

namespace ssd_mma {

// The launch's parameters and workspace views (SsdBwdMmaParams: kernels/params.h, generated from
// `BwdMmaParams` in src/ops/ssd/mod.rs, which describes the fields).
using ::SsdBwdMmaParams;

__device__ __forceinline__ int64_t n_records(const SsdBwdMmaParams& a) { return (a.n_parts - 1) * a.records_per_part; }
// The tiles [begin, end) of record r's piece (end <= begin: an empty piece).
__device__ __forceinline__ void record_tiles(const SsdBwdMmaParams& a, int64_t r, int64_t& begin, int64_t& end) {
    piece_tiles(a.chunks_per_part * (a.q.fwd.chunk_size / kQ), a.records_per_part, r / a.records_per_part + 1,
                r % a.records_per_part, (a.q.fwd.seqlen + kQ - 1) / kQ, begin, end);
}

// The states entering tiles 1.. of a chunk, recomputed before the walk back through it, are kept in
// T (as mma operands they are rounded to T anyway; only <dS, S> sees the rounding): the last in
// registers, the one before in shared memory, any earlier one (chunk_size 256: tile 1) in global
// scratch, each thread its own accumulators as T pairs. All three as f32 scratch made this kernel
// ~30 us slower (H100, 8x2048x64x64x128).
constexpr int kScratchSlots = 1;  // (chunk_size / kQ) - 3 at chunk_size 256, the largest

template <typename T, int N> struct BwdSmem {
    T x[kQ * pitch<kP>()];
    T dy[kQ * pitch<kP>()];
    T b[kQ * pitch<N>()];
    T c[kQ * pitch<N>()];
    T s[kP * pitch<N>()];   // the state entering the tile
    T ds[kP * pitch<N>()];  // the gradient of the state leaving it
    TileScalars sc;
    float vcol[kWarps][kQ];  // per warp, per t: sum over its rows s of V[t, s] dt_s
    float intra[kQ];         // per s: sum over t of V[t, s] = L (C_t.B_s)(dy_t.x_s)
    float state[kQ];         // per s: 2^(cum_last - cum_s) x_s . (dS B_s)
    float y0[kQ];            // per t: 2^cum_t C_t . (dy_t S)
    float sds[kWarps];       // <dS, S> partials
    uint4 kept[kP * N / 8];  // the state entering the chunk's last tile but one (thread-own, as T pairs)
};

// The launcher sizes shared memory by this formula (src/ops/ssd/cuda_mma.rs).
static_assert(sizeof(BwdSmem<bf16, 128>) == 21264 + 512 * (128 + 8) + 128 * 128 &&
                  sizeof(BwdSmem<f16, 64>) == 21264 + 512 * (64 + 8) + 128 * 64,
              "mirror of bwd_shared_bytes");

// A fragments (m16 x k16) from a row block of f32 accumulators over two n-tiles.
template <typename T> __device__ __forceinline__ void to_a_frag(uint32_t a[4], const float* lo, const float* hi) {
    a[0] = pack_u32<T>(lo[0], lo[1]);
    a[1] = pack_u32<T>(lo[2], lo[3]);
    a[2] = pack_u32<T>(hi[0], hi[1]);
    a[3] = pack_u32<T>(hi[2], hi[3]);
}
// Scales the rows (lane/4 and lane/4 + 8) of an A fragment.
template <typename T> __device__ __forceinline__ void scale_a_rows(uint32_t a[4], float lo, float hi) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const float2 v = Ops<T>::unpack2(*reinterpret_cast<const typename Ops<T>::T2*>(&a[r]));
        const float f = r & 1 ? hi : lo;
        a[r] = pack_u32<T>(v.x * f, v.y * f);
    }
}
// The same in T arithmetic (one rounding per element: the factors are <= 1).
template <typename T> __device__ __forceinline__ void scale_a_rows_t2(uint32_t a[4], float lo, float hi) {
    using T2 = typename Ops<T>::T2;
    const T2 f[2] = {Ops<T>::pack2(lo, lo), Ops<T>::pack2(hi, hi)};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const T2 v = __hmul2(*reinterpret_cast<const T2*>(&a[r]), f[r & 1]);
        a[r] = *reinterpret_cast<const uint32_t*>(&v);
    }
}
// The same with f split into two T parts (hi = f rounded, lo = f - hi rounded): fma(a, hi, a lo) is
// within about one rounding of the f32 product, in two T-pair instructions a register instead of
// scale_a_rows' five (unpack, two multiplies, pack).
template <typename T> __device__ __forceinline__ void scale_a_rows_split(uint32_t a[4], float lo, float hi) {
    using T2 = typename Ops<T>::T2;
    const T2 lo_hi = Ops<T>::pack2(lo, lo), hi_hi = Ops<T>::pack2(hi, hi);
    const float2 lo_r = Ops<T>::unpack2(lo_hi), hi_r = Ops<T>::unpack2(hi_hi);
    const T2 f_hi[2] = {lo_hi, hi_hi}, f_lo[2] = {Ops<T>::pack2(lo - lo_r.x, lo - lo_r.x), Ops<T>::pack2(hi - hi_r.x, hi - hi_r.x)};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const T2 v = *reinterpret_cast<const T2*>(&a[r]);
        const T2 out = __hfma2(v, f_hi[r & 1], __hmul2(v, f_lo[r & 1]));
        a[r] = *reinterpret_cast<const uint32_t*>(&out);
    }
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
// dst[0..8) = src[0..8) * f in T arithmetic (16-byte shared accesses).
template <typename T> __device__ __forceinline__ void scale8(T* dst, const T* src, float f) {
    using T2 = typename Ops<T>::T2;
    uint4 v = *reinterpret_cast<const uint4*>(src);
    T2* e = reinterpret_cast<T2*>(&v);
    const T2 f2 = Ops<T>::pack2(f, f);
#pragma unroll
    for (int i = 0; i < 4; ++i) e[i] = __hmul2(e[i], f2);
    *reinterpret_cast<uint4*>(dst) = v;
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
// Per row of a block of f32 accumulators (this thread's rows r_lo, r_hi; COLS columns), the dot with
// the same rows of a T tile of pitch PITCH, summed over the quad that holds the row.
template <typename T, int COLS, int PITCH>
__device__ __forceinline__ float2 row_dots(const float (&acc)[COLS / 8][4], const T* tile, int r_lo, int r_hi) {
    using T2 = typename Ops<T>::T2;
    float lo = 0.f, hi = 0.f;
#pragma unroll
    for (int j = 0; j < COLS / 8; ++j) {
        const int col = 8 * j + 2 * (threadIdx.x % 4);
        const float2 vlo = Ops<T>::unpack2(*reinterpret_cast<const T2*>(&tile[r_lo * PITCH + col]));
        const float2 vhi = Ops<T>::unpack2(*reinterpret_cast<const T2*>(&tile[r_hi * PITCH + col]));
        lo += vlo.x * acc[j][0] + vlo.y * acc[j][1];
        hi += vhi.x * acc[j][2] + vhi.y * acc[j][3];
    }
    return make_float2(quad_sum(lo), quad_sum(hi));
}

// acc += (rows o (lo, hi)) state over k = p, for the warp's rows 16 warp..: rows a (kQ x kP) tile
// at shared address `rows` whose two rows per thread are scaled by lo, hi; state a (kP x N) tile.
template <typename T, int N>
__device__ __forceinline__ void rows_times_state(float (&acc)[N / 8][4], uint32_t rows, float lo, float hi, uint32_t state) {
    constexpr int PX = pitch<kP>(), PN = pitch<N>(), E = sizeof(T);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int a_rows = lane & 15, a_cols = (lane >> 4) * 8;
    const int bt_rows = (lane & 7) + ((lane >> 3) & 1) * 8, bt_cols = (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < kP / 16; ++kk) {
        uint32_t af[4];
        ldsm_x4(af, rows + ((16 * warp + a_rows) * PX + 16 * kk + a_cols) * E);
        scale_a_rows<T>(af, lo, hi);
#pragma unroll
        for (int q = 0; q < N / 16; ++q) {
            uint32_t bb[4];
            ldsm_x4_trans(bb, state + ((16 * kk + bt_rows) * PN + 16 * q + bt_cols) * E);
            mma_pair<T>(acc[2 * q], acc[2 * q + 1], af, bb);
        }
    }
}

// acc += sum over k-blocks pr >= warp of a[pr] tile[16 pr.., :] (k = step, t >= s): a the A fragments
// of the warp's 16 rows per 16-step block, tile a (kQ x COLS) tile at shared address `tile`.
template <typename T, int COLS, int PITCH>
__device__ __forceinline__ void add_upper_times_tile(float (&acc)[COLS / 8][4], const uint32_t (&a)[kQ / 16][4], uint32_t tile,
                                                     int warp, int bt_rows, int bt_cols) {
    constexpr int E = sizeof(T);
#pragma unroll
    for (int pr = 0; pr < kQ / 16; ++pr) {
        if (pr < warp) continue;
#pragma unroll
        for (int q = 0; q < COLS / 16; ++q) {
            uint32_t bb[4];
            ldsm_x4_trans(bb, tile + ((16 * pr + bt_rows) * PITCH + 16 * q + bt_cols) * E);
            mma_pair<T>(acc[2 * q], acc[2 * q + 1], a[pr], bb);
        }
    }
}

// The first `rows` rows of a shared tile of COLS columns (pitch<COLS>()) to rows dst_pitch elements
// apart at dst, in 16-byte pieces, by warps 1.. of the block.
template <typename T, int COLS>
__device__ __forceinline__ void copy_tile_out(T* dst, int64_t dst_pitch, const T* src, int rows) {
    constexpr int kVec = 16 / sizeof(T), kRowVecs = COLS / kVec;
    for (int i = threadIdx.x - 32; i < rows * kRowVecs; i += kThreads - 32) {
        const int row = i / kRowVecs, v = i % kRowVecs;
        *reinterpret_cast<uint4*>(dst + row * dst_pitch + v * kVec) =
            *reinterpret_cast<const uint4*>(src + row * pitch<COLS>() + v * kVec);
    }
}

// PARTIALS: dB and dC per head into db_part / dc_part (reduce_bc sums them), for few heads per group;
// else each chunk's S and dS for the head-sum kernels below.
template <typename T, int N, bool LOCAL, bool PARTIALS> __device__ __forceinline__ void ssd_bwd_mma(const SsdBwdMmaParams& a) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    BwdSmem<T, N>& sm = *reinterpret_cast<BwdSmem<T, N>*>(smem_raw);
    using O = Ops<T>;
    using T2 = typename O::T2;
    constexpr int PX = pitch<kP>(), PN = pitch<N>(), E = sizeof(T);
    const SsdParams& p = a.q.fwd;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t bh = blockIdx.x, b = bh / p.heads, h = bh % p.heads, g = h / (p.heads / p.groups);
    const float A = p.A[h], a_log2 = A * kLog2e, dt_bias = ssd_dt_bias(p, h);
    const int64_t state_elems = int64_t(kP) * N;
    const int64_t n_chunks = ssd_chunk_count(p), tiles_per_chunk = p.chunk_size / kQ;
    // LOCAL: blockIdx.y is a record (a piece of a part), else a part.
    const int64_t part = LOCAL ? 0 : blockIdx.y, bhs = p.batch * p.heads;
    const int64_t chunk_begin = part * a.chunks_per_part, chunk_end = min(chunk_begin + a.chunks_per_part, n_chunks);
    float* records = a.records;
    float* record_decay = records + n_records(a) * bhs * state_elems;
    if (tiles_per_chunk - 3 > kScratchSlots) __trap();  // chunk_size past 256: plan.rs sizes no more
    // head_msum does not read what this kernel writes: it may take SMs as this grid's last blocks drain.
    if (!LOCAL && !PARTIALS) pdl_launch_dependents();

    // Per-lane ldmatrix offsets (elements), as in the forward.
    const int a_rows = lane & 15, a_cols = (lane >> 4) * 8;
    const int bn_rows = (lane & 7) + ((lane >> 4) << 3), bn_cols = ((lane >> 3) & 1) * 8;
    const int bt_rows = (lane & 7) + ((lane >> 3) & 1) * 8, bt_cols = (lane >> 4) * 8;
    const int at_rows = (lane & 7) + (lane >> 4) * 8, at_cols = ((lane >> 3) & 1) * 8;
    const uint32_t xs = smem_addr(sm.x), dys = smem_addr(sm.dy), bs = smem_addr(sm.b), cs = smem_addr(sm.c);
    const uint32_t ss = smem_addr(sm.s), dss = smem_addr(sm.ds);
    const int r_lo = 16 * warp + lane / 4, r_hi = r_lo + 8;  // this thread's accumulator rows
    // PARTIALS: a tile's dB or dC of this head (rows r_lo, r_hi of acc) into (batch, seqlen, heads, N).
    auto store_partial = [&](const float (&acc)[N / 8][4], void* part, int64_t t0) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int64_t t = t0 + (half ? r_hi : r_lo);
            if (t >= p.seqlen) continue;
            T* dst = static_cast<T*>(part) + ((b * p.seqlen + t) * p.heads + h) * N + 2 * (lane % 4);
#pragma unroll
            for (int q = 0; q < N / 8; ++q)
                *reinterpret_cast<T2*>(dst + 8 * q) = O::pack2(acc[q][2 * half], acc[q][2 * half + 1]);
        }
    };
    // Tile loads: x (and dy) rows of kP, B (and C) rows of N elements; zero past the end.
    const TileCopy<kP> xcopy;
    const TileCopy<N> bccopy;
    float tile_dt_raw[2];  // warp 0: the raw dt of steps 2 lane (+1) of the tile last loaded
    // Warp 0: the raw dt of the tile prefetch_tile named last (starting at step dt_ahead_t0), read
    // then, a tile before load_tile wants it. (Read in load_tile, its latency held every warp at the
    // barrier there.)
    T dt_ahead[2];
    int64_t dt_ahead_t0 = -1;
    // This thread's first element of x, dy (B, C) at the block's first step: per tile one multiply
    // moves it, per copy a pointer step (64-bit index arithmetic per copy was on every tile's path).
    const int64_t x_first = ((b * p.seqlen + xcopy.row0) * p.heads + h) * kP + xcopy.col;
    const int64_t bc_first = ((b * p.seqlen + bccopy.row0) * p.groups + g) * N + bccopy.col;
    auto load_tile = [&](int64_t t0, bool states, bool grads) {
        const int rows = tile_rows(p.seqlen, t0);
        const int64_t x_pass = TileCopy<kP>::kRowStep * p.heads * kP, bc_pass = TileCopy<N>::kRowStep * p.groups * N;
        const T* x_at = static_cast<const T*>(p.x) + x_first + t0 * p.heads * kP;
        const T* dy_at = static_cast<const T*>(a.q.dy) + x_first + t0 * p.heads * kP;
#pragma unroll
        for (int k = 0; k < TileCopy<kP>::kPasses; ++k) {
            const int row = xcopy.row0 + k * TileCopy<kP>::kRowStep;
            const bool valid = row < rows;
            if (states) cp_async16(&sm.x[row * PX + xcopy.col], valid ? x_at : p.x, valid);
            if (grads) cp_async16(&sm.dy[row * PX + xcopy.col], valid ? dy_at : a.q.dy, valid);
            x_at += x_pass;
            dy_at += x_pass;
        }
        const T* b_at = static_cast<const T*>(p.B) + bc_first + t0 * p.groups * N;
        const T* c_at = static_cast<const T*>(p.C) + bc_first + t0 * p.groups * N;
#pragma unroll
        for (int k = 0; k < TileCopy<N>::kPasses; ++k) {
            const int row = bccopy.row0 + k * TileCopy<N>::kRowStep;
            const bool valid = row < rows;
            if (states) cp_async16(&sm.b[row * PN + bccopy.col], valid ? b_at : p.B, valid);
            if (grads) cp_async16(&sm.c[row * PN + bccopy.col], valid ? c_at : p.C, valid);
            b_at += bc_pass;
            c_at += bc_pass;
        }
        cp_async_commit();
        if (warp == 0) {
            if (t0 == dt_ahead_t0) {
#pragma unroll
                for (int e = 0; e < 2; ++e) tile_dt_raw[e] = to_f32(dt_ahead[e]);
            } else {
                load_dt_f32<T>(p, b, h, t0, tile_dt_raw);
            }
            tile_scalars(sm.sc, p, dt_bias, a_log2, t0, tile_dt_raw);
        }
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();
    };
    // Loads are single-buffered (two blocks per SM leave no room for a second buffer): pull the tile
    // the block loads next into L2 while it computes on this one. Each thread: rows of x, dy (one
    // 128-byte line each), dt (one line) and B, C (N / 64 lines each); warp 0 also reads its dt.
    auto prefetch_tile = [&](int64_t t0) {
        if (t0 < 0 || t0 >= p.seqlen) return;
        if (warp == 0) {
            load_dt<T>(p, b, h, t0, dt_ahead);
            dt_ahead_t0 = t0;
        }
        const int row = tid % kQ, which = tid / kQ;  // 128 threads: two per row
        const int64_t t = t0 + row;
        if (t >= p.seqlen) return;
        const T* xrow = static_cast<const T*>(which ? a.q.dy : p.x) + ((b * p.seqlen + t) * p.heads + h) * kP;
        const T* bcrow = static_cast<const T*>(which ? p.C : p.B) + ((b * p.seqlen + t) * p.groups + g) * N;
        prefetch_l2(xrow);
        if (!which) prefetch_l2(static_cast<const T*>(p.dt) + (b * p.seqlen + t) * p.heads + h);
#pragma unroll
        for (int k = 0; k < N * int(sizeof(T)) / 128; ++k) prefetch_l2(bcrow + k * 128 / sizeof(T));
    };
    auto cum_of = [&](int t) {
        const float4 v = sm.sc.cd[t / 2];
        return t & 1 ? v.z : v.x;
    };
    auto dt_of = [&](int t) {
        const float4 v = sm.sc.cd[t / 2];
        return t & 1 ? v.w : v.y;
    };
    // States read as T pairs are left unconverted, each pair's bits in its first accumulator, until
    // widen_state before their first use: converted at the read, each waited for the read right there
    // (~4% of this kernel's stall samples), not while the work in between runs. Not with PARTIALS:
    // there ptxas then spills ~110 bytes more.
    constexpr bool kLateWiden = !PARTIALS;
    auto widen_state = [&](float (&acc)[N / 8][4]) {
#pragma unroll
        for (int n = 0; n < N / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const uint32_t bits = __float_as_uint(acc[n][e]);
                const float2 v = O::unpack2(*reinterpret_cast<const T2*>(&bits));
                acc[n][e] = v.x;
                acc[n][e + 1] = v.y;
            }
    };
    // The saved state entering a chunk (T), into this thread's accumulator positions, unconverted
    // (widen_state). (4-byte loads: the full-sector loads and lane swaps that suit the forward's
    // stores cost this kernel spills.)
    auto load_chunk_state = [&](float (&dst)[N / 8][4], int64_t chunk) {
        const T* base = static_cast<const T*>(p.chunk_states) + (bh * kP * n_chunks + chunk) * N;
        for_state_pairs<N>(dst, [&](float* acc, int row, int col) {
            acc[0] = __uint_as_float(*reinterpret_cast<const uint32_t*>(base + row * n_chunks * N + col));
        });
    };
    // Where the state entering tile j (1 <= j <= tiles - 2) of a chunk of `tiles` tiles is kept: the
    // thread's accumulators as T pairs, two accumulator groups per uint4, its uint4s kThreads apart.
    auto kept_slot = [&](int64_t j, int64_t tiles) {
        if (j == tiles - 2) return &sm.kept[tid];
        return static_cast<uint4*>(a.scratch) + ((part * bhs + bh) * kScratchSlots + (j - 1)) * (state_elems / 8) + tid;
    };

    // dS: the gradient of the state leaving the current tile. A part starts from dfinal_states folded
    // back through the records of the parts after it, last to first (LOCAL: from zero).
    float ds[N / 8][4];
    for_state_pairs<N>(ds, [&](float* acc, int row, int col) {
        float2 v = make_float2(0.f, 0.f);
        if (!LOCAL && a.q.dfinal_states)
            v = *reinterpret_cast<const float2*>(a.q.dfinal_states + bh * state_elems + row * N + col);
        acc[0] = v.x;
        acc[1] = v.y;
    });
    if (!LOCAL) {
        const int64_t after = part * a.records_per_part;  // the records of the parts after this one
        fold_records<N>(ds, records + bh * state_elems, record_decay + bh, bhs, n_records(a) - 1, n_records(a) - after, -1);
    }
    // acc <- 2^cum_last acc + (f o steps)^T cols over the tile's steps, rows p = 16 warp..: steps
    // (kQ x kP) and cols (kQ x N) are tiles, f the per-step factors as pairs (steps 2i, 2i + 1).
    auto decay_add_product = [&](float (&acc)[N / 8][4], uint32_t steps, const float2* f, uint32_t cols) {
        const float decay = ex2_ftz(sm.sc.cd[kQ / 2 - 1].z);
#pragma unroll
        for (int n = 0; n < N / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[n][e] *= decay;
#pragma unroll
        for (int kk = 0; kk < kQ / 16; ++kk) {
            uint32_t af[4];
            ldsm_x4_trans(af, steps + ((16 * kk + at_rows) * PX + 16 * warp + at_cols) * E);
            scale_a_cols<T>(af, f[8 * kk + lane % 4], f[8 * kk + 4 + lane % 4]);
#pragma unroll
            for (int q = 0; q < N / 16; ++q) {
                uint32_t bb[4];
                ldsm_x4_trans(bb, cols + ((16 * kk + bt_rows) * PN + 16 * q + bt_cols) * E);
                mma_pair<T>(acc[2 * q], acc[2 * q + 1], af, bb);
            }
        }
    };
    // dS <- 2^cum_last dS + (2^cum o dy)^T C (the tile's dy, C and scalars loaded).
    auto update_ds = [&]() { decay_add_product(ds, dys, reinterpret_cast<const float2*>(sm.sc.ecum), cs); };
    if (LOCAL) {
        const int64_t r = blockIdx.y;
        int64_t tile_begin, tile_end;
        record_tiles(a, r, tile_begin, tile_end);
        float decay_sum = 0.f;
        for (int64_t t0 = (tile_end - 1) * kQ; t0 >= tile_begin * kQ; t0 -= kQ) {
            load_tile(t0, false, true);
            prefetch_tile(t0 - kQ);
            decay_sum += sm.sc.cd[kQ / 2 - 1].z;
            update_ds();
            __syncthreads();
        }
        float* rec = records + (r * bhs + bh) * state_elems;
        for_state_pairs<N>(ds, [&](float* acc, int row, int col) {
            *reinterpret_cast<float2*>(rec + row * N + col) = make_float2(acc[0], acc[1]);
        });
        if (tid == 0) record_decay[r * bhs + bh] = decay_sum;
        return;
    }
    float dd_acc[kP / 8][2] = {};  // sum of dy x over this thread's (rows, columns 8j + 2(lane%4) (+1))
    float dskip[kP / 8][2];        // D of those columns
    load_dskip(dskip, p, h);
    float da_acc = 0.f, dbias_acc = 0.f;  // warp 0

    for (int64_t chunk = chunk_end - 1; chunk >= chunk_begin; --chunk) {
        const int64_t c0 = chunk * p.chunk_size;
        const int64_t tiles = min(tiles_per_chunk, (p.seqlen - c0 + kQ - 1) / kQ);
        // S entering tile j (f32, this thread's accumulator positions). First the states entering
        // tiles 1..tiles-1 are recomputed; the last stays here, the others are kept (kept_slot).
        float sv[N / 8][4];
        load_chunk_state(sv, chunk);
        if (!kLateWiden) widen_state(sv);
        for (int64_t j = 0; j + 1 < tiles; ++j) {
            load_tile(c0 + j * kQ, true, false);
            prefetch_tile(c0 + (j + 1) * kQ);  // the last one: the first of the walk back
            if (kLateWiden && j == 0) widen_state(sv);
            decay_add_product(sv, xs, sm.sc.w, bs);  // S <- 2^cum_last S + (w o x)^T B
            if (j + 2 < tiles) {
                uint4* slot = kept_slot(j + 1, tiles);
#pragma unroll
                for (int n = 0; n < N / 8; n += 2)
                    slot[n / 2 * kThreads] = make_uint4(pack_u32<T>(sv[n][0], sv[n][1]), pack_u32<T>(sv[n][2], sv[n][3]),
                                                        pack_u32<T>(sv[n + 1][0], sv[n + 1][1]),
                                                        pack_u32<T>(sv[n + 1][2], sv[n + 1][3]));
            }
            __syncthreads();
        }
        if (kLateWiden && tiles == 1) widen_state(sv);
        // The next tile's entering state, read a tile ahead (unconverted: widen_state) so that a global
        // read's latency passes while warp 0 finishes the tile before.
        auto load_entering = [&](int64_t j) {
            if (j == 0) {
                load_chunk_state(sv, chunk);
                if (!kLateWiden) widen_state(sv);
                return;
            }
            const uint4* slot = kept_slot(j, tiles);
#pragma unroll
            for (int n = 0; n < N / 8; n += 2) {
                const uint4 v = slot[n / 2 * kThreads];
                const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int k = 0; k < 4; ++k) sv[n + k / 2][2 * (k % 2)] = __uint_as_float(w[k]);
            }
            if (!kLateWiden) widen_state(sv);
        };
        for (int64_t j = tiles - 1; j >= 0; --j) {
            const int64_t t0 = c0 + j * kQ;
            // <dS, S>, and both rounded to T into shared memory.
            float sds = 0.f;
            {
#pragma unroll
                for (int n = 0; n < N / 8; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) sds = fmaf(ds[n][e], sv[n][e], sds);
                for_state_pairs<N>(sv, [&](float* acc, int row, int col) {
                    *reinterpret_cast<T2*>(&sm.s[row * PN + col]) = O::pack2(acc[0], acc[1]);
                });
                for_state_pairs<N>(ds, [&](float* acc, int row, int col) {
                    *reinterpret_cast<T2*>(&sm.ds[row * PN + col]) = O::pack2(acc[0], acc[1]);
                });
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sds += __shfl_xor_sync(0xffffffffu, sds, o);
            if (lane == 0) sm.sds[warp] = sds;
            load_tile(t0, true, true);  // ends with __syncthreads: the writes above are visible too
            prefetch_tile(j > 0 ? t0 - kQ : c0 - p.chunk_size);  // the walk's next tile, or the chunk before's first

            const float cum_last = sm.sc.cd[kQ / 2 - 1].z;
            const float cum_lo = cum_of(r_lo), cum_hi = cum_of(r_hi);
            const float dt_lo = dt_of(r_lo), dt_hi = dt_of(r_hi);

            // ---- Rows s = 16 warp.. : dx, dB, and the dt terms of s.
            {
                float p1[kQ / 8][4] = {};  // C_t . B_s for t-tiles >= 2 warp
                float dx[kP / 8][4] = {};  // first dS B_s, then dx
#pragma unroll
                for (int kk = 0; kk < N / 16; ++kk) {
                    uint32_t af[4];
                    ldsm_x4(af, bs + ((16 * warp + a_rows) * PN + 16 * kk + a_cols) * E);
#pragma unroll
                    for (int pr = 0; pr < kQ / 16; ++pr) {
                        if (pr < warp) continue;  // t >= s
                        uint32_t bb[4];
                        ldsm_x4(bb, cs + ((16 * pr + bn_rows) * PN + 16 * kk + bn_cols) * E);
                        mma_pair<T>(p1[2 * pr], p1[2 * pr + 1], af, bb);
                    }
#pragma unroll
                    for (int pr = 0; pr < kP / 16; ++pr) {
                        uint32_t bb[4];
                        ldsm_x4(bb, dss + ((16 * pr + bn_rows) * PN + 16 * kk + bn_cols) * E);
                        mma_pair<T>(dx[2 * pr], dx[2 * pr + 1], af, bb);
                    }
                }
                // state_s = 2^(cum_last - cum_s) x_s . (dS B_s); then dx = w_s dS B_s.
                const float2 xdot = row_dots<T, kP, PX>(dx, sm.x, r_lo, r_hi);
                const float decay_lo = ex2_ftz(cum_last - cum_lo), decay_hi = ex2_ftz(cum_last - cum_hi);
                const float st_lo = xdot.x * decay_lo, st_hi = xdot.y * decay_hi;
                if (lane % 4 == 0) {
                    sm.state[r_lo] = st_lo;
                    sm.state[r_hi] = st_hi;
                }
                const float w_lo = decay_lo * dt_lo, w_hi = decay_hi * dt_hi;
#pragma unroll
                for (int jn = 0; jn < kP / 8; ++jn) {
                    dx[jn][0] *= w_lo, dx[jn][1] *= w_lo, dx[jn][2] *= w_hi, dx[jn][3] *= w_hi;
                }
                // x_s . dy_t for t-tiles >= 2 warp.
                float g2[kQ / 8][4] = {};
#pragma unroll
                for (int kk = 0; kk < kP / 16; ++kk) {
                    uint32_t af[4];
                    ldsm_x4(af, xs + ((16 * warp + a_rows) * PX + 16 * kk + a_cols) * E);
#pragma unroll
                    for (int pr = 0; pr < kQ / 16; ++pr) {
                        if (pr < warp) continue;
                        uint32_t bb[4];
                        ldsm_x4(bb, dys + ((16 * pr + bn_rows) * PX + 16 * kk + bn_cols) * E);
                        mma_pair<T>(g2[2 * pr], g2[2 * pr + 1], af, bb);
                    }
                }
                // Mask and decay: a1 = P1 L dt_s (for dx), V = P1 G2 L.
                uint32_t a1[kQ / 16][4], a2[kQ / 16][4];  // a2 = G2 L dt_s (PARTIALS: for dB)
                float in_lo = 0.f, in_hi = 0.f;
#pragma unroll
                for (int nt = 0; nt < kQ / 8; ++nt) {
                    float vsum[2] = {0.f, 0.f};  // over rows, for columns t0, t0 + 1
                    if (nt >= 2 * warp) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int t = 8 * nt + 2 * (lane % 4) + (e & 1), srow = e < 2 ? r_lo : r_hi;
                            const float l = t >= srow ? ex2_ftz(cum_of(t) - (e < 2 ? cum_lo : cum_hi)) : 0.f;
                            const float dts = e < 2 ? dt_lo : dt_hi;
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
                    if (lane < 4) {
                        sm.vcol[warp][8 * nt + 2 * lane] = vsum[0];
                        sm.vcol[warp][8 * nt + 2 * lane + 1] = vsum[1];
                    }
                }
                in_lo = quad_sum(in_lo);
                in_hi = quad_sum(in_hi);
                if (lane % 4 == 0) {
                    sm.intra[r_lo] = in_lo;
                    sm.intra[r_hi] = in_hi;
                }
#pragma unroll
                for (int pr = 0; pr < kQ / 16; ++pr) {
                    to_a_frag<T>(a1[pr], p1[2 * pr], p1[2 * pr + 1]);
                    if (PARTIALS) to_a_frag<T>(a2[pr], g2[2 * pr], g2[2 * pr + 1]);
                }
                add_upper_times_tile<T, kP, PX>(dx, a1, dys, warp, bt_rows, bt_cols);  // dx += a1 dy (k = t)
                // dx += D dy; dD partials; store (the head sums: over this thread's x in shared memory,
                // which nothing reads after this, for warps 1.. to copy out with the chunk states).
                T* dx_out = static_cast<T*>(a.q.dx);
                if constexpr (!PARTIALS) __syncwarp();  // the warp's ldmatrix reads of its x rows first
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = half ? r_hi : r_lo;
                    const int64_t t = t0 + row;
#pragma unroll
                    for (int jn = 0; jn < kP / 8; ++jn) {
                        const int col = 8 * jn + 2 * (lane % 4);
                        const float2 dyv = O::unpack2(*reinterpret_cast<const T2*>(&sm.dy[row * PX + col]));
                        const float2 xv = O::unpack2(*reinterpret_cast<const T2*>(&sm.x[row * PX + col]));
                        dd_acc[jn][0] += dyv.x * xv.x;
                        dd_acc[jn][1] += dyv.y * xv.y;
                        const T2 dxv =
                            O::pack2(dx[jn][2 * half] + dskip[jn][0] * dyv.x, dx[jn][2 * half + 1] + dskip[jn][1] * dyv.y);
                        if constexpr (!PARTIALS)
                            *reinterpret_cast<T2*>(&sm.x[row * PX + col]) = dxv;
                        else if (t < p.seqlen)
                            *reinterpret_cast<T2*>(dx_out + ((b * p.seqlen + t) * p.heads + h) * kP + col) = dxv;
                    }
                }
                if constexpr (PARTIALS) {  // this head's dB = w_s x_s^T dS + a2 C
                    float db[N / 8][4] = {};
                    rows_times_state<T, N>(db, xs, w_lo, w_hi, dss);
                    add_upper_times_tile<T, N, PN>(db, a2, cs, warp, bt_rows, bt_cols);
                    store_partial(db, a.db_part, t0);
                }
            }

            // ---- Rows t = 16 warp.. : the y term of cum_t (and PARTIALS: this head's dC).
            {
                const float e_lo = sm.sc.ecum[r_lo], e_hi = sm.sc.ecum[r_hi];
                float dc[N / 8][4] = {};  // first 2^cum_t dy_t S
                rows_times_state<T, N>(dc, dys, e_lo, e_hi, ss);
                const float2 cdot = row_dots<T, N, PN>(dc, sm.c, r_lo, r_hi);
                if (lane % 4 == 0) {
                    sm.y0[r_lo] = cdot.x;
                    sm.y0[r_hi] = cdot.y;
                }
                if constexpr (PARTIALS) {  // dC = 2^cum_t dy_t S (in dc already) + a3 B, a3 = G2 L dt_s
                    float g2[kQ / 8][4] = {};  // dy_t . x_s for s-tiles <= warp
#pragma unroll
                    for (int kk = 0; kk < kP / 16; ++kk) {
                        uint32_t af[4];
                        ldsm_x4(af, dys + ((16 * warp + a_rows) * PX + 16 * kk + a_cols) * E);
#pragma unroll
                        for (int pr = 0; pr < kQ / 16; ++pr) {
                            if (pr > warp) break;
                            uint32_t bb[4];
                            ldsm_x4(bb, xs + ((16 * pr + bn_rows) * PX + 16 * kk + bn_cols) * E);
                            mma_pair<T>(g2[2 * pr], g2[2 * pr + 1], af, bb);
                        }
                    }
#pragma unroll
                    for (int pr = 0; pr < kQ / 16; ++pr) {
                        if (pr > warp) break;
                        uint32_t a3[4];
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            float* acc = g2[2 * pr + half];
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int s = 16 * pr + 8 * half + 2 * (lane % 4) + (e & 1), trow = e < 2 ? r_lo : r_hi;
                                acc[e] = s <= trow ? acc[e] * ex2_ftz((e < 2 ? cum_lo : cum_hi) - cum_of(s)) * dt_of(s) : 0.f;
                            }
                        }
                        to_a_frag<T>(a3, g2[2 * pr], g2[2 * pr + 1]);
#pragma unroll
                        for (int q = 0; q < N / 16; ++q) {
                            uint32_t bb[4];
                            ldsm_x4_trans(bb, bs + ((16 * pr + bt_rows) * PN + 16 * q + bt_cols) * E);
                            mma_pair<T>(dc[2 * q], dc[2 * q + 1], a3, bb);
                        }
                    }
                    store_partial(dc, a.dc_part, t0);
                }
            }

            update_ds();
            // (Unconditional: a conditional load would keep this tile's S live through the body.)
            load_entering(j > 0 ? j - 1 : 0);
            __syncthreads();

            // ---- Warp 0: the gradient of cum, then ddt and dA. Lane l owns steps 2l and 2l + 1.
            //   dCum_t = y0_t + sum_s V[t,s] dt_s - dt_t intra_t - dt_t state_t
            //            (+ at the last step: 2^cum_last <dS, S> + sum_s dt_s state_s)
            //   ddt_t  = intra_t + state_t + A sum_{t' >= t} dCum_t',  dA += dt_t sum_{t' >= t} dCum_t'
            if (warp == 0) {
                float dcum[2], dts[2], direct[2];
                float u_sum = 0.f;
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int t = 2 * lane + e;
                    dts[e] = dt_of(t);
                    float vc = 0.f;
#pragma unroll
                    for (int w = 0; w < kWarps; ++w) vc += sm.vcol[w][t];
                    direct[e] = sm.intra[t] + sm.state[t];
                    dcum[e] = sm.y0[t] + vc - dts[e] * direct[e];
                    u_sum += dts[e] * sm.state[t];
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) u_sum += __shfl_xor_sync(0xffffffffu, u_sum, o);
                if (lane == 31) {
                    float sds_all = 0.f;
#pragma unroll
                    for (int w = 0; w < kWarps; ++w) sds_all += sm.sds[w];
                    dcum[1] += ex2_ftz(cum_last) * sds_all + u_sum;
                }
                // Suffix sums over the tile: R_t = sum_{t' >= t} dCum_t'.
                const float pair = dcum[0] + dcum[1];
                float suffix = pair;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const float other = __shfl_down_sync(0xffffffffu, suffix, o);
                    if (lane + o < 32) suffix += other;
                }
                const float r1 = suffix - pair + dcum[1], r0 = suffix;
                const float rs[2] = {r0, r1};
                T* ddt_out = static_cast<T*>(a.q.ddt);
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int64_t t = t0 + 2 * lane + e;
                    if (t >= p.seqlen) continue;
                    const float ddt = direct[e] + A * rs[e];
                    da_acc += dts[e] * rs[e];
                    // Through the clamp, softplus and bias to the raw dt (kept from the tile's load).
                    const int64_t idx = (b * p.seqlen + t) * p.heads + h;
                    const float v = tile_dt_raw[e] + dt_bias;
                    bool passes;
                    ssd_dt(p, tile_dt_raw[e], dt_bias, &passes);
                    float graw = passes ? ddt : 0.f;
                    if (p.dt_softplus) graw *= 1.f / (1.f + expf(-v));
                    ddt_out[idx] = from_f32<T>(graw);
                    dbias_acc += graw;
                }
            } else if constexpr (!PARTIALS) {
                // Meanwhile the other warps store the tile's dx and, for bc_sums, the chunk's S
                // (entering, at its first tile) and dS (leaving, at its last) from shared memory, in
                // 16-byte pieces. (Stored from the registers, in 4-byte pieces, in the middle of the
                // products, they cost the main kernel ~100 us at the main shape.)
                copy_tile_out<T, kP>(static_cast<T*>(a.q.dx) + ((b * p.seqlen + t0) * p.heads + h) * kP, p.heads * kP, sm.x,
                                     int(min(int64_t(kQ), p.seqlen - t0)));
                if (j == 0) copy_tile_out<T, N>(static_cast<T*>(a.s_chunk) + (bh * n_chunks + chunk) * state_elems, N, sm.s, kP);
                if (j == tiles - 1)
                    copy_tile_out<T, N>(static_cast<T*>(a.ds_chunk) + (bh * n_chunks + chunk) * state_elems, N, sm.ds, kP);
            }
            if (kLateWiden) widen_state(sv);  // load_entering's, after the work above
            __syncthreads();  // before the next tile's loads overwrite shared memory
        }
    }

    // dinitial_states, and the per-(part, batch, head) partials.
    if (part == 0 && a.q.dinitial_states) {
        for_state_pairs<N>(ds, [&](float* acc, int row, int col) {
            *reinterpret_cast<float2*>(a.q.dinitial_states + bh * state_elems + row * N + col) = make_float2(acc[0], acc[1]);
        });
    }
    // dD: sum the thread's columns over its rows (all lanes with equal lane % 4, all warps).
    float* dd_cols = sm.intra;  // reused: kP floats
    if (tid < kP) dd_cols[tid] = 0.f;
    __syncthreads();
#pragma unroll
    for (int jn = 0; jn < kP / 8; ++jn)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float v = dd_acc[jn][e];
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            dd_acc[jn][e] = v;
        }
    for (int w = 0; w < kWarps; ++w) {  // fixed order over warps
        if (warp == w && lane < 4) {
#pragma unroll
            for (int jn = 0; jn < kP / 8; ++jn) {
                dd_cols[8 * jn + 2 * lane] += dd_acc[jn][0];
                dd_cols[8 * jn + 2 * lane + 1] += dd_acc[jn][1];
            }
        }
        __syncthreads();
    }
    if (tid < kP) a.dd_part[(part * bhs + bh) * kP + tid] = dd_cols[tid];
    if (warp == 0) {  // each lane of warp 0 summed its own steps
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            da_acc += __shfl_xor_sync(0xffffffffu, da_acc, o);
            dbias_acc += __shfl_xor_sync(0xffffffffu, dbias_acc, o);
        }
        if (lane == 0) {
            a.da_part[part * bhs + bh] = da_acc;
            a.dbias_part[part * bhs + bh] = dbias_acc;
        }
    }
}

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
            const float a1 = dt[1] * a_log2;
            float run = dt[0] * a_log2 + a1;
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
// The whole (mirror of msum_shared_bytes in src/ops/ssd/cuda_mma.rs): two stages, the scaled x, and
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
// The whole (mirror of bc_shared_bytes in src/ops/ssd/cuda_mma.rs): the stages, plus slack to align
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

// With z: y = y_pre silu(z). Before the ungated backward runs with dy silu(z) as its dy: dz =
// dy y_pre silu'(z), y_pre recomputed by the forward kernel into `gated`, dy silu(z) over it (each
// element read before it is written). Two elements per thread, grid-stride.
template <typename T> __device__ __forceinline__ void gate_grad(const SsdBwdMmaParams& a) {
    using T2 = typename Ops<T>::T2;
    const SsdParams& p = a.q.fwd;
    const int64_t pairs = p.batch * p.seqlen * p.heads * kP / 2;
    const T2* z = static_cast<const T2*>(p.z);
    const T2* dy = static_cast<const T2*>(a.q.dy);
    const T2* y_pre = static_cast<const T2*>(a.gated);
    T2* dz = static_cast<T2*>(a.q.dz);
    T2* dy_gated = static_cast<T2*>(a.gated);
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pairs; i += int64_t(gridDim.x) * blockDim.x) {
        const float2 zv = Ops<T>::unpack2(z[i]), g = Ops<T>::unpack2(dy[i]), y = Ops<T>::unpack2(y_pre[i]);
        const float s0 = 1.f / (1.f + expf(-zv.x)), s1 = 1.f / (1.f + expf(-zv.y));
        dz[i] = Ops<T>::pack2(g.x * y.x * s0 * (1.f + zv.x * (1.f - s0)), g.y * y.y * s1 * (1.f + zv.y * (1.f - s1)));
        dy_gated[i] = Ops<T>::pack2(g.x * zv.x * s0, g.y * zv.y * s1);
    }
}

// The per-head path: dB, dC summed over a group's heads from the partials, in a fixed order
// (grid-stride over (batch, seqlen, groups) x 8-state vectors: 16-byte loads).
template <typename T> __device__ __forceinline__ void reduce_bc(const SsdBwdMmaParams& a) {
    using T2 = typename Ops<T>::T2;
    const SsdParams& p = a.q.fwd;
    constexpr int V = 8;  // states per thread (dstate is 64 or 128)
    const int64_t vecs = p.dstate / V, total = p.batch * p.seqlen * p.groups * vecs, per_group = p.heads / p.groups;
    T* dB = static_cast<T*>(a.q.dB);
    T* dC = static_cast<T*>(a.q.dC);
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t v = i % vecs, g = (i / vecs) % p.groups, bl = i / (vecs * p.groups);
        const int64_t base = (bl * p.heads + g * per_group) * p.dstate + v * V;
        float sb[V] = {}, sc[V] = {};
#pragma unroll 4
        for (int64_t k = 0; k < per_group; ++k) {
            const uint4 rb = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.db_part) + base + k * p.dstate);
            const uint4 rc = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.dc_part) + base + k * p.dstate);
            const T2* eb = reinterpret_cast<const T2*>(&rb);
            const T2* ec = reinterpret_cast<const T2*>(&rc);
#pragma unroll
            for (int e = 0; e < V / 2; ++e) {
                const float2 fb = Ops<T>::unpack2(eb[e]), fc = Ops<T>::unpack2(ec[e]);
                sb[2 * e] += fb.x, sb[2 * e + 1] += fb.y;
                sc[2 * e] += fc.x, sc[2 * e + 1] += fc.y;
            }
        }
        const int64_t out = i * V;  // (bl, g, v) row-major = the element offset / V
#pragma unroll
        for (int e = 0; e < V; ++e) {
            dB[out + e] = from_f32<T>(sb[e]);
            dC[out + e] = from_f32<T>(sc[e]);
        }
    }
}

// The sum of v over a block of kP threads, in a fixed order (`partial`: two floats of shared memory).
__device__ __forceinline__ float block_sum_kp(float v, float* partial) {
    static_assert(kP == 64, "two warps");
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    return partial[0] + partial[1];
}
// A block of kP threads per head: thread `col` sums column col of dD over the (part, batch) rows, and
// every kP-th row of dA and ddt_bias; block_sum_kp adds the threads' sums.
__device__ __forceinline__ void reduce_params(const SsdBwdMmaParams& a) {
    __shared__ float partial[3][2];
    pdl_wait_prerequisite();  // launched programmatically after bc_sums or reduce_bc
    const SsdParams& p = a.q.fwd;
    const int64_t h = blockIdx.x, col = threadIdx.x, rows = a.n_parts * p.batch;  // (part, batch) pairs
    float dd = 0.f, da = 0.f, dbias = 0.f;
    if (a.q.dD) {
#pragma unroll 8
        for (int64_t r = 0; r < rows; ++r) dd += a.dd_part[(r * p.heads + h) * kP + col];
        if (p.D_per_channel) a.q.dD[h * kP + col] = dd;
    }
    for (int64_t r = col; r < rows; r += kP) {
        da += a.da_part[r * p.heads + h];
        dbias += a.dbias_part[r * p.heads + h];
    }
    const float dd_all = block_sum_kp(dd, partial[0]), da_all = block_sum_kp(da, partial[1]);
    const float dbias_all = block_sum_kp(dbias, partial[2]);
    if (col != 0) return;
    if (a.q.dD && !p.D_per_channel) a.q.dD[h] = dd_all;
    a.q.dA[h] = da_all;
    if (a.q.ddt_bias) a.q.ddt_bias[h] = dbias_all;
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
