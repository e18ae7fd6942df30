// Mamba-2 SSD backward on tensor cores (docs/ssd.md): bf16 / f16, headdim 64, dstate 64 or 128,
// chunk_size a multiple of 64. src/ops/ssd/cuda.rs takes it where it applies. The main kernel has no
// z: with z, gate_grad turns dy into the gradient of y before the gate first.
//
// One block of 4 warps walks one (batch, head) backwards through the sequence, the gradient dS of the
// state leaving the current 64-step tile in mma accumulators (warp w: rows p = 16w..). Per chunk, the
// states entering its tiles are first recomputed from the chunk's saved state (into scratch, each
// thread its own accumulators). Per tile, with cum, dt, w as in the forward, L[t, s] = 2^(cum_t -
// cum_s) for s <= t, S the state entering the tile (rounded to T as an mma operand):
//   dx  = (B C^T o L)^T-ish products:  dx[s]  = dt_s sum_t L (C_t.B_s) dy_t + w_s (dS B_s) + D dy_s
//   dB[s] = dt_s sum_t L (dy_t.x_s) C_t + w_s x_s^T dS         (per head; summed over the group later)
//   dC[t] = sum_s L dt_s (dy_t.x_s) B_s + 2^cum_t dy_t S        (likewise)
//   dS   <- 2^cum_last dS + sum_t 2^cum_t dy_t^T C_t
// and ddt / dA from the gradient of cum (see tile_dt_grads). Warp w computes the step-major products
// for rows s = 16w.. (columns t >= s) and t = 16w.. (columns s <= t). dB and dC go to per-head f32
// partials in the workspace; dA, ddt_bias and dD to per-(batch, head) partials; the reduce kernels
// sum them in a fixed order (no atomics: bitwise-repeatable).
#include "ssd_mma.cuh"

namespace ssd_mma {

// Workspace views of a backward launch (mirror of `BwdMmaParams` in src/ops/ssd/cuda_mma.rs).
struct SsdBwdMmaParams {
    SsdBwdParams q;
    // (batch, seqlen, heads, dstate) per-head dB and dC in the inputs' type T: half the traffic of
    // f32 (these partials were a fifth of the backward's time), T's precision; summed in f32. (bf16
    // partials for f16 inputs lost f16's precision in dB and dC.)
    void* db_part;
    void* dc_part;
    float* scratch;     // (n_parts, batch * heads, tiles per chunk - 1, kP * dstate): recomputed states
    float* da_part;     // (n_parts, batch, heads)
    float* dbias_part;  // (n_parts, batch, heads)
    float* dd_part;     // (n_parts, batch, heads, kP)
    // Sequence split (few batch x heads): parts of chunks_per_part chunks; parts 1..n_parts-1 record
    // the gradient entering them from their own steps and their total decay (log2):
    // [n_parts - 1][batch * heads][kP * dstate], then [n_parts - 1][batch * heads].
    float* records;
    int64_t chunks_per_part, n_parts;
};

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
};

// The launcher sizes shared memory by this formula (src/ops/ssd/cuda_mma.rs).
static_assert(sizeof(BwdSmem<bf16, 128>) == 21264 + 512 * (128 + 8) && sizeof(BwdSmem<f16, 64>) == 21264 + 512 * (64 + 8),
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

template <typename T, int N, bool LOCAL> __device__ __forceinline__ void ssd_bwd_mma(const SsdBwdMmaParams& a) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    BwdSmem<T, N>& sm = *reinterpret_cast<BwdSmem<T, N>*>(smem_raw);
    using O = Ops<T>;
    using T2 = typename O::T2;
    constexpr int PX = pitch<kP>(), PN = pitch<N>(), E = sizeof(T);
    const SsdParams& p = a.q.fwd;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t bh = blockIdx.x, b = bh / p.heads, h = bh % p.heads, g = h / (p.heads / p.groups);
    const float A = p.A[h], a_log2 = A * kLog2e, dt_bias = p.dt_bias ? p.dt_bias[h] : 0.f;
    const int64_t state_elems = int64_t(kP) * N;
    const int64_t n_chunks = ssd_chunk_count(p), tiles_per_chunk = p.chunk_size / kQ;
    const int64_t part = LOCAL ? blockIdx.y + 1 : blockIdx.y, bhs = p.batch * p.heads;
    const int64_t chunk_begin = part * a.chunks_per_part, chunk_end = min(chunk_begin + a.chunks_per_part, n_chunks);
    float* records = a.records;
    float* record_decay = records + (a.n_parts - 1) * bhs * state_elems;

    // Per-lane ldmatrix offsets (elements), as in the forward.
    const int a_rows = lane & 15, a_cols = (lane >> 4) * 8;
    const int bn_rows = (lane & 7) + ((lane >> 4) << 3), bn_cols = ((lane >> 3) & 1) * 8;
    const int bt_rows = (lane & 7) + ((lane >> 3) & 1) * 8, bt_cols = (lane >> 4) * 8;
    const int at_rows = (lane & 7) + (lane >> 4) * 8, at_cols = ((lane >> 3) & 1) * 8;
    const uint32_t xs = smem_addr(sm.x), dys = smem_addr(sm.dy), bs = smem_addr(sm.b), cs = smem_addr(sm.c);
    const uint32_t ss = smem_addr(sm.s), dss = smem_addr(sm.ds);
    const int r_lo = 16 * warp + lane / 4, r_hi = r_lo + 8;  // this thread's accumulator rows
    // acc += (rows o (lo, hi)) state over k = p, rows t or s = 16 warp..: rows a (kQ x kP) tile, its
    // two rows per thread scaled; state a (kP x N) tile.
    auto add_rows_times_state = [&](float (&acc)[N / 8][4], uint32_t rows, float lo, float hi, uint32_t state) {
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
    };
    // A tile's per-head dB or dC (rows r_lo, r_hi of acc) into its partials (batch, seqlen, heads, N).
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
    auto load_tile = [&](int64_t t0, bool states, bool grads) {
        const T* x = static_cast<const T*>(p.x);
        const T* dy = static_cast<const T*>(a.q.dy);
#pragma unroll
        for (int k = 0; k < TileCopy<kP>::kPasses; ++k) {
            const int row = xcopy.row0 + k * TileCopy<kP>::kRowStep;
            const bool valid = t0 + row < p.seqlen;
            const int64_t off = valid ? ((b * p.seqlen + t0 + row) * p.heads + h) * kP + xcopy.col : 0;
            if (states) cp_async16(&sm.x[row * PX + xcopy.col], x + off, valid);
            if (grads) cp_async16(&sm.dy[row * PX + xcopy.col], dy + off, valid);
        }
        const T* Bm = static_cast<const T*>(p.B);
        const T* Cm = static_cast<const T*>(p.C);
#pragma unroll
        for (int k = 0; k < TileCopy<N>::kPasses; ++k) {
            const int row = bccopy.row0 + k * TileCopy<N>::kRowStep;
            const bool valid = t0 + row < p.seqlen;
            const int64_t off = valid ? ((b * p.seqlen + t0 + row) * p.groups + g) * N + bccopy.col : 0;
            if (states) cp_async16(&sm.b[row * PN + bccopy.col], Bm + off, valid);
            if (grads) cp_async16(&sm.c[row * PN + bccopy.col], Cm + off, valid);
        }
        cp_async_commit();
        if (warp == 0) {
            load_dt<T>(p, b, h, t0, tile_dt_raw);
            tile_scalars(sm.sc, p, h, a_log2, t0, tile_dt_raw);
        }
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();
    };
    // Loads are single-buffered (two blocks per SM leave no room for a second buffer): pull the tile
    // the block loads next into L2 while it computes on this one. Each thread: rows of x, dy (one
    // 128-byte line each), dt (one line) and B, C (N / 64 lines each).
    auto prefetch_tile = [&](int64_t t0) {
        if (t0 < 0 || t0 >= p.seqlen) return;
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
    // The saved state entering a chunk, into this thread's accumulator positions.
    auto load_chunk_state = [&](float (&dst)[N / 8][4], int64_t chunk) {
        for_state_pairs<N>(dst, [&](float* acc, int row, int col) {
            const float2 v = *reinterpret_cast<const float2*>(p.chunk_states + ((bh * kP + row) * n_chunks + chunk) * N + col);
            acc[0] = v.x;
            acc[1] = v.y;
        });
    };
    // Scratch slot of the state entering tile j (>= 1) of a chunk: each thread's accumulators as float4s.
    auto scratch_slot = [&](int64_t j) {
        return reinterpret_cast<float4*>(a.scratch + ((part * bhs + bh) * (tiles_per_chunk - 1) + (j - 1)) * state_elems) + tid;
    };

    // dS: the gradient of the state leaving the current tile. A part starts from dfinal_states folded
    // back through the records of the parts after it (LOCAL: from zero).
    float ds[N / 8][4];
    for_state_pairs<N>(ds, [&](float* acc, int row, int col) {
        float2 v = make_float2(0.f, 0.f);
        if (!LOCAL && a.q.dfinal_states)
            v = *reinterpret_cast<const float2*>(a.q.dfinal_states + bh * state_elems + row * N + col);
        acc[0] = v.x;
        acc[1] = v.y;
    });
    for (int64_t r = LOCAL ? part : a.n_parts - 1; r > part; --r) {
        const float decay = exp2f(record_decay[(r - 1) * bhs + bh]);
        const float* rec = records + ((r - 1) * bhs + bh) * state_elems;
        for_state_pairs<N>(ds, [&](float* acc, int row, int col) {
            const float2 v = *reinterpret_cast<const float2*>(rec + row * N + col);
            acc[0] = fmaf(decay, acc[0], v.x);
            acc[1] = fmaf(decay, acc[1], v.y);
        });
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
        float decay_sum = 0.f;
        for (int64_t t0 = (min(chunk_end * p.chunk_size, p.seqlen) - 1) / kQ * kQ; t0 >= chunk_begin * p.chunk_size; t0 -= kQ) {
            load_tile(t0, false, true);
            prefetch_tile(t0 - kQ);
            decay_sum += sm.sc.cd[kQ / 2 - 1].z;
            update_ds();
            __syncthreads();
        }
        float* rec = records + ((part - 1) * bhs + bh) * state_elems;
        for_state_pairs<N>(ds, [&](float* acc, int row, int col) {
            *reinterpret_cast<float2*>(rec + row * N + col) = make_float2(acc[0], acc[1]);
        });
        if (tid == 0) record_decay[(part - 1) * bhs + bh] = decay_sum;
        return;
    }
    float dd_acc[kP / 8][2] = {};  // sum of dy x over this thread's (rows, columns 8j + 2(lane%4) (+1))
    float dskip[kP / 8][2];        // D of those columns
    load_dskip(dskip, p, h);
    float da_acc = 0.f, dbias_acc = 0.f;  // warp 0

    for (int64_t chunk = chunk_end - 1; chunk >= chunk_begin; --chunk) {
        const int64_t c0 = chunk * p.chunk_size;
        const int64_t tiles = min(tiles_per_chunk, (p.seqlen - c0 + kQ - 1) / kQ);
        // Recompute the states entering tiles 1..tiles-1 of the chunk.
        if (tiles > 1) {
            float s[N / 8][4];
            load_chunk_state(s, chunk);
            for (int64_t j = 0; j + 1 < tiles; ++j) {
                load_tile(c0 + j * kQ, true, false);
                prefetch_tile(c0 + (j + 1) * kQ);  // the last one: the first of the walk back
                decay_add_product(s, xs, sm.sc.w, bs);  // S <- 2^cum_last S + (w o x)^T B
                float4* slot = scratch_slot(j + 1);
#pragma unroll
                for (int n = 0; n < N / 8; ++n) slot[n * kThreads] = make_float4(s[n][0], s[n][1], s[n][2], s[n][3]);
                __syncthreads();
            }
        }

        // S entering tile j (f32, this thread's accumulator positions): issued a tile ahead, so that
        // its latency passes while warp 0 finishes the tile before.
        float sv[N / 8][4];
        auto load_entering = [&](int64_t j) {
            if (j == 0) {
                load_chunk_state(sv, chunk);
            } else {
                const float4* slot = scratch_slot(j);
#pragma unroll
                for (int n = 0; n < N / 8; ++n) {
                    const float4 v = slot[n * kThreads];
                    sv[n][0] = v.x, sv[n][1] = v.y, sv[n][2] = v.z, sv[n][3] = v.w;
                }
            }
        };
        load_entering(tiles - 1);
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
                // Mask and decay: a1 = P1 L dt_s (for dx), a2 = G2 L dt_s (for dB), V = P1 G2 L.
                uint32_t a1[kQ / 16][4], a2[kQ / 16][4];
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
                            g2[nt][e] *= l * dts;
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
                    to_a_frag<T>(a2[pr], g2[2 * pr], g2[2 * pr + 1]);
                }
                // dx += a1 dy (k = t).
#pragma unroll
                for (int pr = 0; pr < kQ / 16; ++pr) {
                    if (pr < warp) continue;
#pragma unroll
                    for (int q = 0; q < kP / 16; ++q) {
                        uint32_t bb[4];
                        ldsm_x4_trans(bb, dys + ((16 * pr + bt_rows) * PX + 16 * q + bt_cols) * E);
                        mma_pair<T>(dx[2 * q], dx[2 * q + 1], a1[pr], bb);
                    }
                }
                // dx += D dy; dD partials; store.
                T* dx_out = static_cast<T*>(a.q.dx);
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
                        if (t < p.seqlen) {
                            *reinterpret_cast<T2*>(dx_out + ((b * p.seqlen + t) * p.heads + h) * kP + col) =
                                O::pack2(dx[jn][2 * half] + dskip[jn][0] * dyv.x, dx[jn][2 * half + 1] + dskip[jn][1] * dyv.y);
                        }
                    }
                }
                // dB = w_s x_s^T dS + a2 C.
                float db[N / 8][4] = {};
                add_rows_times_state(db, xs, w_lo, w_hi, dss);
#pragma unroll
                for (int pr = 0; pr < kQ / 16; ++pr) {
                    if (pr < warp) continue;
#pragma unroll
                    for (int q = 0; q < N / 16; ++q) {
                        uint32_t bb[4];
                        ldsm_x4_trans(bb, cs + ((16 * pr + bt_rows) * PN + 16 * q + bt_cols) * E);
                        mma_pair<T>(db[2 * q], db[2 * q + 1], a2[pr], bb);
                    }
                }
                store_partial(db, a.db_part, t0);
            }

            // ---- Rows t = 16 warp.. : dC and the y term of cum_t.
            {
                const float e_lo = sm.sc.ecum[r_lo], e_hi = sm.sc.ecum[r_hi];
                float dc[N / 8][4] = {};  // first 2^cum_t dy_t S
                add_rows_times_state(dc, dys, e_lo, e_hi, ss);
                const float2 cdot = row_dots<T, N, PN>(dc, sm.c, r_lo, r_hi);
                if (lane % 4 == 0) {
                    sm.y0[r_lo] = cdot.x;
                    sm.y0[r_hi] = cdot.y;
                }
                // dy_t . x_s for s-tiles <= 2 warp + 1, masked and decayed: a3 = G2 L dt_s.
                float g2[kQ / 8][4] = {};
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
                    ssd_dt(p, tile_dt_raw[e], h, &passes);
                    float graw = passes ? ddt : 0.f;
                    if (p.dt_softplus) graw *= 1.f / (1.f + expf(-v));
                    ddt_out[idx] = from_f32<T>(graw);
                    dbias_acc += graw;
                }
            }
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

// Fixed-order sums of the partials: dB, dC over the heads of a group (grid-stride over (batch, seqlen,
// groups) x 8-state vectors: 16-byte loads, 4 heads in flight); then dA, ddt_bias, dD over the batch
// (one thread per (head, p)).
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

// With z: y = y_pre silu(z). Before the ungated backward runs with dy silu(z) as its dy: dz =
// dy y_pre silu'(z), y_pre recomputed by the forward kernel into db_part (the backward kernel
// overwrites it later), dy silu(z) into dx (the backward kernel reads each tile's dy before it
// writes that tile's dx). Two elements per thread, grid-stride.
template <typename T> __device__ __forceinline__ void gate_grad(const SsdBwdMmaParams& a) {
    using T2 = typename Ops<T>::T2;
    const SsdParams& p = a.q.fwd;
    const int64_t pairs = p.batch * p.seqlen * p.heads * kP / 2;
    const T2* z = static_cast<const T2*>(p.z);
    const T2* dy = static_cast<const T2*>(a.q.dy);
    const T2* y_pre = static_cast<const T2*>(a.db_part);
    T2* dz = static_cast<T2*>(a.q.dz);
    T2* dy_gated = static_cast<T2*>(a.q.dx);
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pairs; i += int64_t(gridDim.x) * blockDim.x) {
        const float2 zv = Ops<T>::unpack2(z[i]), g = Ops<T>::unpack2(dy[i]), y = Ops<T>::unpack2(y_pre[i]);
        const float s0 = 1.f / (1.f + expf(-zv.x)), s1 = 1.f / (1.f + expf(-zv.y));
        dz[i] = Ops<T>::pack2(g.x * y.x * s0 * (1.f + zv.x * (1.f - s0)), g.y * y.y * s1 * (1.f + zv.y * (1.f - s1)));
        dy_gated[i] = Ops<T>::pack2(g.x * zv.x * s0, g.y * zv.y * s1);
    }
}

__device__ __forceinline__ void reduce_params(const SsdBwdMmaParams& a) {
    const SsdParams& p = a.q.fwd;
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;  // (head, p)
    if (i >= p.heads * kP) return;
    const int64_t h = i / kP, col = i % kP;
    const int64_t rows = a.n_parts * p.batch;  // (part, batch) pairs
    if (a.q.dD && (p.D_per_channel || col == 0)) {
        float s = 0.f;
        for (int64_t r = 0; r < rows; ++r) {
            if (p.D_per_channel) {
                s += a.dd_part[(r * p.heads + h) * kP + col];
            } else {
                for (int c = 0; c < kP; ++c) s += a.dd_part[(r * p.heads + h) * kP + c];
            }
        }
        a.q.dD[p.D_per_channel ? i : h] = s;
    }
    if (col == 0) {
        float da = 0.f, dbias = 0.f;
        for (int64_t r = 0; r < rows; ++r) {
            da += a.da_part[r * p.heads + h];
            dbias += a.dbias_part[r * p.heads + h];
        }
        a.q.dA[h] = da;
        if (a.q.ddt_bias) a.q.ddt_bias[h] = dbias;
    }
}

}  // namespace ssd_mma

// extern "C" entry points: ssd_bwd_mma[_local]_<T>_n<N> (grid (batch * heads, n_parts [- 1]),
// kThreads threads, sizeof(BwdSmem<T, N>) bytes of dynamic shared memory), ssd_bwd_reduce_bc_<T>
// (grid-stride over (batch, seqlen, groups, dstate / 8)), ssd_bwd_reduce_params (a thread per (head, p)),
// ssd_bwd_gate_grad_<T> (grid-stride over element pairs; before the main kernel, with z).
#define SSD_BWD_MMA(T, N)                                                                          \
    extern "C" __global__ void __launch_bounds__(ssd_mma::kThreads, 2)                             \
        ssd_bwd_mma_##T##_n##N(const ssd_mma::SsdBwdMmaParams a) {                                 \
        ssd_mma::ssd_bwd_mma<T, N, false>(a);                                                      \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(ssd_mma::kThreads, 2)                             \
        ssd_bwd_mma_local_##T##_n##N(const ssd_mma::SsdBwdMmaParams a) {                           \
        ssd_mma::ssd_bwd_mma<T, N, true>(a);                                                       \
    }
SSD_BWD_MMA(bf16, 64)
SSD_BWD_MMA(bf16, 128)
SSD_BWD_MMA(f16, 64)
SSD_BWD_MMA(f16, 128)
#define SSD_BWD_REDUCE(T)                                                                           \
    extern "C" __global__ void ssd_bwd_reduce_bc_##T(const ssd_mma::SsdBwdMmaParams a) {           \
        ssd_mma::reduce_bc<T>(a);                                                          \
    }                                                                                               \
    extern "C" __global__ void ssd_bwd_gate_grad_##T(const ssd_mma::SsdBwdMmaParams a) {           \
        ssd_mma::gate_grad<T>(a);                                                          \
    }
SSD_BWD_REDUCE(bf16)
SSD_BWD_REDUCE(f16)
extern "C" __global__ void ssd_bwd_reduce_params(const ssd_mma::SsdBwdMmaParams a) { ssd_mma::reduce_params(a); }
