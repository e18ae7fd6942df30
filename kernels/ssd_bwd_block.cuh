// One block of the tensor-core SSD backward's main kernel (ssd_bwd_mma.cuh, whose phases take it by
// reference): its shared memory, its (batch, head), part and chunks, per-lane fragment offsets, and
// what the phases share: the tile loads with their dt look-ahead, the tile's scalars, and the states
// entering a chunk's tiles (recomputed forward, kept, then read back walking backwards).
#pragma once
#include "ssd_bwd_frags.cuh"

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

// The launcher sizes shared memory by this formula (src/cuda/ssd_mma.rs).
static_assert(sizeof(BwdSmem<bf16, 128>) == 21264 + 512 * (128 + 8) + 128 * 128 &&
                  sizeof(BwdSmem<f16, 64>) == 21264 + 512 * (64 + 8) + 128 * 64,
              "mirror of bwd_shared_bytes");

// What the launch gives a block: its (batch, head), part and chunks (grid: batch * heads, then parts,
// or records when `local`: blockIdx.y is then a record, the part 0), and the split's records.
struct BwdLaunch {
    const SsdBwdMmaParams& a;
    const SsdParams& p;
    const int tid, lane, warp;
    const int64_t bh, b, h, g;
    const float A, a_log2, dt_bias;
    const int64_t n_chunks, tiles_per_chunk;
    const int64_t part, bhs;
    const int64_t chunk_begin, chunk_end;
    float* const records;       // [n_records][batch * heads] gradients (kP x N, f32), then
    float* const record_decay;  // [n_records][batch * heads] total decays (log2)
    // Checks the launch, then with `launch_dependents` lets the next grid launch.
    __device__ __forceinline__ BwdLaunch(const SsdBwdMmaParams& a_, int64_t state_elems, bool local,
                                         bool launch_dependents)
        : a(a_), p(a_.q.fwd), tid(threadIdx.x), lane(tid & 31), warp(tid >> 5), bh(blockIdx.x), b(bh / p.heads),
          h(bh % p.heads), g(h / (p.heads / p.groups)), A(p.A[h]), a_log2(A * kLog2e), dt_bias(ssd_dt_bias(p, h)),
          n_chunks(ssd_chunk_count(p)), tiles_per_chunk(p.chunk_size / kQ), part(local ? 0 : blockIdx.y),
          bhs(p.batch * p.heads), chunk_begin(part * a.chunks_per_part),
          chunk_end(min(chunk_begin + a.chunks_per_part, n_chunks)), records(a.records),
          record_decay(records + n_records(a) * bhs * state_elems) {
        if (tiles_per_chunk - 3 > kScratchSlots) __trap();  // chunk_size past 256: plan.rs sizes no more
        // head_msum does not read what this kernel writes: it may take SMs as this grid's last blocks drain.
        if (launch_dependents) pdl_launch_dependents();
    }
};

// Warp 0's dt of the tiles, as references to the kernel's locals (held as fields of a struct, the
// values changed the kernel's generated code).
template <typename T> struct TileDt {
    float (&raw)[2];  // the raw dt of steps 2 lane (+1) of the tile last loaded
    // The raw dt of the tile prefetch_tile named last (starting at step ahead_t0), read then, a tile
    // before load_tile wants it. (Read in load_tile, its latency held every warp at the barrier there.)
    T (&ahead)[2];
    int64_t& ahead_t0;
};

// The tile's scalars at this thread's accumulator rows r_lo, r_hi, and its last step's cum.
struct RowScalars {
    float cum_last, cum_lo, cum_hi, dt_lo, dt_hi;
};

// What the main kernel's phases read (by const reference): the launch, the shared memory, per-lane
// offsets into its tiles, and the tile loads. LOCAL and PARTIALS: as for ssd_bwd_mma.
template <typename T, int N, bool LOCAL, bool PARTIALS> struct BwdBlock : BwdLaunch {
    using O = Ops<T>;
    using T2 = typename O::T2;
    static constexpr int PX = pitch<kP>(), PN = pitch<N>(), E = sizeof(T);
    static constexpr int64_t state_elems = int64_t(kP) * N;
    // States read as T pairs are left unconverted, each pair's bits in its first accumulator, until
    // widen_state before their first use: converted at the read, each waited for the read right there
    // (~4% of this kernel's stall samples), not while the work in between runs. Not with PARTIALS:
    // there ptxas then spills ~110 bytes more.
    static constexpr bool kLateWiden = !PARTIALS;

    BwdSmem<T, N>& sm;
    // Per-lane ldmatrix offsets (elements), as in the forward.
    const int a_rows, a_cols, bn_rows, bn_cols, bt_rows, bt_cols, at_rows, at_cols;
    const uint32_t xs, dys, bs, cs, ss, dss;  // the shared tiles' addresses
    const int r_lo, r_hi;                      // this thread's accumulator rows
    // Tile loads: x (and dy) rows of kP, B (and C) rows of N elements; zero past the end.
    const TileCopy<kP> xcopy;
    const TileCopy<N> bccopy;
    // This thread's first element of x, dy (B, C) at the block's first step: per tile one multiply
    // moves it, per copy a pointer step (64-bit index arithmetic per copy was on every tile's path).
    const int64_t x_first, bc_first;

    __device__ __forceinline__ BwdBlock(const SsdBwdMmaParams& a_, BwdSmem<T, N>& sm_)
        : BwdLaunch(a_, state_elems, LOCAL, !LOCAL && !PARTIALS), sm(sm_), a_rows(lane & 15), a_cols((lane >> 4) * 8),
          bn_rows((lane & 7) + ((lane >> 4) << 3)), bn_cols(((lane >> 3) & 1) * 8),
          bt_rows((lane & 7) + ((lane >> 3) & 1) * 8), bt_cols((lane >> 4) * 8),
          at_rows((lane & 7) + (lane >> 4) * 8), at_cols(((lane >> 3) & 1) * 8), xs(smem_addr(sm.x)),
          dys(smem_addr(sm.dy)), bs(smem_addr(sm.b)), cs(smem_addr(sm.c)), ss(smem_addr(sm.s)),
          dss(smem_addr(sm.ds)), r_lo(16 * warp + lane / 4), r_hi(r_lo + 8),
          x_first(((b * p.seqlen + xcopy.row0) * p.heads + h) * kP + xcopy.col),
          bc_first(((b * p.seqlen + bccopy.row0) * p.groups + g) * N + bccopy.col) {}

    // Loads the tile at step t0 (x and B if `states`, dy and C if `grads`) and, in warp 0, its
    // scalars; ends with a barrier.
    __device__ __forceinline__ void load_tile(int64_t t0, bool states, bool grads, const TileDt<T>& dt) const {
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
            if (t0 == dt.ahead_t0) {
#pragma unroll
                for (int e = 0; e < 2; ++e) dt.raw[e] = to_f32(dt.ahead[e]);
            } else {
                load_dt_f32<T>(p, b, h, t0, dt.raw);
            }
            tile_scalars(sm.sc, p, dt_bias, a_log2, t0, dt.raw, true, -1, true);
        }
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();
    }
    // Loads are single-buffered (two blocks per SM leave no room for a second buffer): pull the tile
    // the block loads next into L2 while it computes on this one. Each thread: rows of x, dy (one
    // 128-byte line each), dt (one line) and B, C (N / 64 lines each); warp 0 also reads its dt.
    __device__ __forceinline__ void prefetch_tile(int64_t t0, const TileDt<T>& dt) const {
        if (t0 < 0 || t0 >= p.seqlen) return;
        if (warp == 0) {
            load_dt<T>(p, b, h, t0, dt.ahead);
            dt.ahead_t0 = t0;
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
    }
    // cum and dt of step t of the loaded tile.
    __device__ __forceinline__ float cum_of(int t) const {
        const float4 v = sm.sc.cd[t / 2];
        return t & 1 ? v.z : v.x;
    }
    __device__ __forceinline__ float dt_of(int t) const {
        const float4 v = sm.sc.cd[t / 2];
        return t & 1 ? v.w : v.y;
    }
    // The loaded tile's scalars at this thread's rows.
    __device__ __forceinline__ RowScalars row_scalars() const {
        const float cum_last = sm.sc.cd[kQ / 2 - 1].z;
        const float cum_lo = cum_of(r_lo), cum_hi = cum_of(r_hi);
        const float dt_lo = dt_of(r_lo), dt_hi = dt_of(r_hi);
        return {cum_last, cum_lo, cum_hi, dt_lo, dt_hi};
    }
    // A state read as T pairs (see kLateWiden), to f32.
    static __device__ __forceinline__ void widen_state(float (&acc)[N / 8][4]) {
#pragma unroll
        for (int n = 0; n < N / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const uint32_t bits = __float_as_uint(acc[n][e]);
                const float2 v = O::unpack2(*reinterpret_cast<const T2*>(&bits));
                acc[n][e] = v.x;
                acc[n][e + 1] = v.y;
            }
    }
    // The saved state entering a chunk (T), into this thread's accumulator positions, unconverted
    // (widen_state). (4-byte loads: the full-sector loads and lane swaps that suit the forward's
    // stores cost this kernel spills.)
    __device__ __forceinline__ void load_chunk_state(float (&dst)[N / 8][4], int64_t chunk) const {
        const T* base = static_cast<const T*>(p.chunk_states) + (bh * kP * n_chunks + chunk) * N;
        for_state_pairs<N>(dst, [&](float* acc, int row, int col) {
            acc[0] = __uint_as_float(*reinterpret_cast<const uint32_t*>(base + row * n_chunks * N + col));
        });
    }
    // Where the state entering tile j (1 <= j <= tiles - 2) of a chunk of `tiles` tiles is kept: the
    // thread's accumulators as T pairs, two accumulator groups per uint4, its uint4s kThreads apart.
    __device__ __forceinline__ uint4* kept_slot(int64_t j, int64_t tiles) const {
        if (j == tiles - 2) return &sm.kept[tid];
        return static_cast<uint4*>(a.scratch) + ((part * bhs + bh) * kScratchSlots + (j - 1)) * (state_elems / 8) + tid;
    }
    // The state entering tile j into sv, read a tile ahead of its use (unconverted: widen_state) so
    // that a global read's latency passes while warp 0 finishes the tile before.
    __device__ __forceinline__ void load_entering(float (&sv)[N / 8][4], int64_t chunk, int64_t tiles,
                                                  int64_t j) const {
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
    }
    // acc <- 2^cum_last acc + (f o steps)^T cols over the tile's steps, rows p = 16 warp..: steps
    // (kQ x kP) and cols (kQ x N) are tiles, f the per-step factors as pairs (steps 2i, 2i + 1).
    __device__ __forceinline__ void decay_add_product(float (&acc)[N / 8][4], uint32_t steps, const float2* f,
                                                      uint32_t cols) const {
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
    }
    // dS <- 2^cum_last dS + (2^cum o dy)^T C (the tile's dy, C and scalars loaded).
    __device__ __forceinline__ void update_ds(float (&ds)[N / 8][4]) const {
        decay_add_product(ds, dys, reinterpret_cast<const float2*>(sm.sc.ecum), cs);
    }
    // PARTIALS: a tile's dB or dC of this head (rows r_lo, r_hi of acc) into (batch, seqlen, heads, N).
    __device__ __forceinline__ void store_partial(const float (&acc)[N / 8][4], void* partials, int64_t t0) const {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int64_t t = t0 + (half ? r_hi : r_lo);
            if (t >= p.seqlen) continue;
            T* dst = static_cast<T*>(partials) + ((b * p.seqlen + t) * p.heads + h) * N + 2 * (lane % 4);
#pragma unroll
            for (int q = 0; q < N / 8; ++q)
                *reinterpret_cast<T2*>(dst + 8 * q) = O::pack2(acc[q][2 * half], acc[q][2 * half + 1]);
        }
    }
};

}  // namespace ssd_mma
