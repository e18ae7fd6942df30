// Mamba-1 selective scan, backward (docs/selective_scan_bwd.md).
//
// A block takes CB channels of one batch row (of one B/C group) and walks the sequence backwards,
// one checkpoint chunk at a time, with TPC threads per channel holding K = 8 states each in
// registers. Per chunk: a forward pass from the checkpoint records the state entering each S-step
// tile (shared memory); then per tile, backwards: its inputs are staged in shared memory (dt,
// softplus' derivative, dy = dout * silu(z) and dz's factor computed once per element), a forward
// pass records the state entering each SUB-step piece, and per piece, backwards: the SUB steps are
// recomputed into registers (states and decays), then the gradient recurrence
//     g = a[l+1] * g + C[l] * dy[l]
// runs over them and every gradient term is formed from registers. Sums over the channels (dB, dC of
// time-varying B/C) are reduced within a warp by shuffles (a reduce-scatter), across the block's warps
// in shared memory, and across blocks by a second kernel; sums over the batch (dA, dD, ddelta_bias,
// time-invariant dB/dC) by that kernel too. Every sum has a fixed order: the gradients are bitwise
// deterministic. Two exponentials per (step, state) (the tile's forward pass and the recompute),
// plus a part of one for chunks longer than a tile. The next tile's inputs and the next chunk's
// checkpoint travel into shared memory by cp.async while a tile is computed (RawTile). When batch x
// dim gives too few blocks to fill the GPU, the sequence is split in parts scanned in parallel: a
// first pass runs the g recurrence alone per part (one exponential per (step, state)) and records
// where it ends, and each part's block carries the true g in from the records of the parts after it.
#pragma once
#include "selective_scan.cuh"

#include <type_traits>

constexpr int kBwdThreads = 128;
constexpr int kBwdWarps = kBwdThreads / 32;

// 32-step tiles at two blocks per SM. (16-step tiles at four blocks per SM, 128 registers, were 8%
// faster at checkpoint_len 32 while the tiles were staged element by element; with 16-byte vectors
// the 32-step tiles are faster at every shape measured: BENCHMARKS.md, "What did not pay".)
template <int TPC> struct BwdShape {
    static constexpr int K = 8;                  // states per thread
    static constexpr int NMAX = K * TPC;         // states per channel
    static constexpr int CB = kBwdThreads / TPC; // channels per block
    static constexpr int S = 32;                 // steps per tile (divides checkpoint_len)
    static constexpr int SUB = 4;                // steps recomputed into registers at a time
    static constexpr int NSUB = S / SUB;
    static constexpr int P = S + 1;              // pitch of the per-(channel, step) rows
    // Steps of dB/dC warp partials gathered before the block sums them.
    static constexpr int FLUSH = NMAX <= 32 ? 16 : NMAX <= 64 ? 8 : 4;
    static_assert(FLUSH % SUB == 0, "a piece's steps fall in one flush window");
    // Shared memory, in floats: five [CB][P] rows (u then du, dt then ddelta, softplus' derivative,
    // dy, dz's factor then dz); B and C [S][NMAX]; the piece starts [NSUB][K][threads]; the warps'
    // dB/dC partials [warps][FLUSH][2][NMAX]; then the tile starts [tiles][K][threads]; then, when
    // the launch gives room for it, the next tile's raw inputs (RawTile). Two blocks fit an SM for
    // checkpoint_len <= 64 at dstate <= 16, raw tile included for 2-byte inputs. (Smaller variants,
    // bf16 rows and sigmoid recomputed from dt, let three blocks fit only with register spills:
    // slower, BENCHMARKS.md, "What did not pay".)
    static constexpr int kU = 0, kDt = kU + CB * P, kSig = kDt + CB * P, kDy = kSig + CB * P, kDzf = kDy + CB * P;
    static constexpr int kB = kDzf + CB * P, kC = kB + S * NMAX;
    static constexpr int kPiece = kC + S * NMAX;
    static constexpr int kWarpSums = kPiece + NSUB * K * kBwdThreads;
    static constexpr int kTileStart = kWarpSums + kBwdWarps * FLUSH * 2 * NMAX;
    static constexpr int kTileStartFloats = K * kBwdThreads;  // per tile of the chunk
};

// The next tile's inputs as they are in global memory, copied in by cp.async while this tile is
// computed (its staging then reads shared memory, not HBM): u, delta, dout, z [CB x S], then
// time-varying B and C [S x NMAX], in the 16-byte vectors of VecTile, vector v at index v. Mirror:
// `raw_tile_bytes` in src/cuda/selective_scan_bwd.rs.
template <typename T, typename TB, int TPC, bool kVaryingBC> struct RawTile {
    using Sh = BwdShape<TPC>;
    static constexpr int kX = Sh::CB * Sh::S * sizeof(T) / 16;                   // vectors per x tensor
    static constexpr int kBC = kVaryingBC ? Sh::S * Sh::NMAX * sizeof(TB) / 16 : 0;  // per B/C
    static constexpr int kBytes = (4 * kX + 2 * kBC) * 16;
};

__device__ __forceinline__ float rcp_approx(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// 1 / (1 + e^-x) on the special-function units (__frcp_rn's exact reciprocal took ~10 instructions
// and a branch, in a per-element loop); 0 and 1 at the ends.
__device__ __forceinline__ float sigmoid_fast(float x) { return rcp_approx(1.f + ex2_ftz(-x * kLog2e)); }
// sigmoid(x) = (x >= 0 ? 1 : t) / (1 + t) from t = e^-|x| (exp_neg_abs), which softplus(x) has computed.
__device__ __forceinline__ float sigmoid_from_t(float x, float t) { return (x >= 0.f ? 1.f : t) * rcp_approx(1.f + t); }

// A [R rows][S steps] tile of a global array moved in 16-byte vectors of E elements along its
// contiguous axis: vector v covers steps t..t+E of row r (steps contiguous) or rows r..r+E at step t.
template <typename T, int R, int S> struct VecTile {
    static constexpr int E = 16 / sizeof(T);
    static constexpr int kCount = R * S / E;
    static constexpr int kRowVecs = R >= E ? R / E : 1;  // (rows-contiguous tiles need R % E == 0)
    // False for v past the tile.
    static __device__ __forceinline__ bool at(int v, bool steps_contiguous, int& r, int& t) {
        r = steps_contiguous ? v / (S / E) : (v % kRowVecs) * E;
        t = steps_contiguous ? (v % (S / E)) * E : v / kRowVecs;
        return kCount % kBwdThreads == 0 || v < kCount;
    }
    static __device__ __forceinline__ float get(const uint4& v, int e) { return to_f32(reinterpret_cast<const T*>(&v)[e]); }
    // E floats from src[0], src[step], ... converted to T.
    static __device__ __forceinline__ uint4 pack(const float* src, int step) {
        uint4 v;
        T* e = reinterpret_cast<T*>(&v);
#pragma unroll
        for (int j = 0; j < E; ++j) e[j] = from_f32<T>(src[j * step]);
        return v;
    }
};

// The order of a thread's states: register k holds state n0 + (k ^ state_perm(lane)), the two
// halves swapped on lanes with bit 4 set (when it is a channel bit). The reduce-scatter's first round
// then pairs each lane's low half with its partner's high half, which holds the same states: no lane
// selects what to send. (The swap is a choice of float4 address when B and C are read, so those reads
// stay broadcasts; a full permutation would need permuted copies of B and C, and bank conflicts.)
template <int TPC> __device__ __forceinline__ int state_perm(int lane) { return TPC <= 16 ? ((lane >> 4) & 1) * 4 : 0; }

// Sums v[0..8) over the warp's channels (lane bits >= log2(TPC)): a reduce-scatter halves the
// values each round while there are more than one, then plain butterflies. Leaves count values,
// v[j] for state n0 + ((first + j) ^ perm); `writer` is false on lanes whose sums duplicate another's.
template <int TPC>
__device__ __forceinline__ int reduce_scatter_channels(float (&v)[8], int lane, int& first, bool& writer) {
    int count = 8;
    first = 0;
    writer = true;
#pragma unroll
    for (int mask = 16; mask >= TPC; mask /= 2) {
        const bool upper = (lane & mask) != 0;
        if (count > 1) {
            const int half = count / 2;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (j >= half) break;
                if (mask == 16) {
                    v[j] += __shfl_xor_sync(0xffffffffu, v[j + half], mask);
                } else {
                    const float keep = upper ? v[j + half] : v[j];
                    const float send = upper ? v[j] : v[j + half];
                    v[j] = keep + __shfl_xor_sync(0xffffffffu, send, mask);
                }
            }
            if (upper && mask != 16) first += half;
            count = half;
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], mask);
            writer = writer && !upper;
        }
    }
    return count;
}

// Packed sequences (cu_seqlens, batch 1): the boundaries, cu_seqlens[s] for s in [0, num_seqs],
// clamped to [0, seqlen] so that values the host could not check still give positions inside the
// sequence. Every search returns an index in its range whatever the values.
struct BwdSeqs {
    const int32_t* cu;
    int64_t num_seqs, seqlen;
    __device__ __forceinline__ int64_t at(int64_t s) const {
        return min(max(int64_t(__ldg(cu + s)), int64_t(0)), seqlen);
    }
    // The first s in [lo, hi) with at(s) >= l, else hi: bisection (the lower bound of sorted values).
    __device__ __forceinline__ int64_t lower_bound(int64_t l, int64_t lo, int64_t hi) const {
        while (lo < hi) {
            const int64_t mid = lo + (hi - lo) / 2;
            if (at(mid) < l) lo = mid + 1;
            else hi = mid;
        }
        return lo;
    }
    // The same in [0, hi), galloping down from hi first: a block walks the sequence backwards, and its
    // next boundary is usually at or next to the last one it found (one load per tile).
    __device__ __forceinline__ int64_t lower_bound_below(int64_t l, int64_t hi) const {
        int64_t top = hi, bottom = 0;  // the answer is in [bottom, top]
        for (int64_t step = 1; top > 0; step *= 2) {
            const int64_t probe = max(top - step, int64_t(0));
            if (at(probe) < l) {
                bottom = probe + 1;
                break;
            }
            top = probe;
        }
        return lower_bound(l, bottom, top);
    }
};
// Bytes of the packed kernels' dynamic shared memory after the tile starts: the staged tile's
// boundary table, int64 [S + 1] (16-byte multiple). Mirror: `SEQ_TABLE_BYTES` in
// src/cuda/selective_scan_bwd.rs.
constexpr int kBwdSeqTableBytes = ((32 + 1) * 8 + 15) / 16 * 16;

// kLocal: the first pass of a sequence split (p.n_chunks parts of p.chunk_len steps, a whole number
// of checkpoint chunks each). Block (tile, b, z) runs the g recurrence alone over part z + 1 from
// g = 0 and records where it ends (g entering the part before) and the part's sum of dt (its decay
// of an incoming g, exp(A * sum dt)). Otherwise block (tile, b, z) does part z, starting from the
// g that the records of the parts after it carry in.
// kPacked: packed sequences (docs/selective_scan_bwd.md, "Packed sequences"). Every channel of a
// block crosses the same boundaries, so the tests are block-uniform and made a tile at a time: the
// tile's boundaries go to a table in shared memory (s_seq) and a mask of its steps, and only the
// pieces (and forward passes) of a tile with a boundary run the steps that apply the rules.
template <typename T, typename TB, int TPC, bool kVaryingBC, bool kLocal, bool kPacked>
__device__ __forceinline__ void selective_scan_bwd_tiled(const SelectiveScanBwdParams& q) {
    using Sh = BwdShape<TPC>;
    constexpr int K = Sh::K, NMAX = Sh::NMAX, CB = Sh::CB, S = Sh::S, SUB = Sh::SUB, P = Sh::P;
    const SelectiveScanFwdParams& p = q.fwd;
    extern __shared__ __align__(16) float sm[];
    float *s_u = sm + Sh::kU, *s_dt = sm + Sh::kDt, *s_sig = sm + Sh::kSig, *s_dy = sm + Sh::kDy, *s_dzf = sm + Sh::kDzf;
    float *s_B = sm + Sh::kB, *s_C = sm + Sh::kC, *s_piece = sm + Sh::kPiece, *s_warp = sm + Sh::kWarpSums;
    float* s_tile = sm + Sh::kTileStart;

    // The launch sizes shared memory for the chunk's tiles; a mismatch must fail, not corrupt.
    uint32_t shared_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(shared_bytes));
    const uint32_t tile_bytes = (Sh::kTileStart + (p.checkpoint_len + S - 1) / S * Sh::kTileStartFloats) * sizeof(float);
    const uint32_t base_bytes = tile_bytes + (kPacked ? kBwdSeqTableBytes : 0);
    if (shared_bytes < base_bytes) __trap();
    using Raw = RawTile<T, TB, TPC, kVaryingBC>;
    uint4* raw = reinterpret_cast<uint4*>(sm) + base_bytes / 16;  // [4][Raw::kX] x, then [2][Raw::kBC] B/C

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int c = tid / TPC, thread_part = tid % TPC, n0 = thread_part * K;
    // Per-(channel, step) sums over the channel's threads go a piece (SUB steps) at a time.
    using Sums = StepSums<TPC, SUB>;
    const int first_step = Sums::first_step(thread_part);  // of each piece, the first this thread finishes
    const int perm = state_perm<TPC>(lane);
    const int64_t b = blockIdx.y;
    // Blocks tile each group's channels (time-invariant B/C: one group of all channels).
    const int64_t group_dim = kVaryingBC ? p.dim_per_group : p.dim;
    const int64_t tiles_per_group = (group_dim + CB - 1) / CB;
    const int64_t group = blockIdx.x / tiles_per_group, tile_in_group = blockIdx.x % tiles_per_group;
    const int64_t d0 = group * group_dim + tile_in_group * CB;
    const int rows = int(min(int64_t(CB), group_dim - tile_in_group * CB));
    const bool active = c < rows;
    const int64_t d = d0 + (active ? c : 0);
    const int64_t L = p.seqlen, N = p.dstate;
    const int64_t BD = p.batch * p.dim;

    const T* u_g = static_cast<const T*>(p.u);
    const T* delta_g = static_cast<const T*>(p.delta);
    const T* z_g = static_cast<const T*>(p.z);
    const T* dout_g = static_cast<const T*>(q.dout);
    const TB* B_g = static_cast<const TB*>(p.B);
    const TB* C_g = static_cast<const TB*>(p.C);
    const bool time_contiguous = p.x_stride_seq == 1;
    const bool bc_time_contiguous = p.bc_stride_seq == 1;
    // 16-byte vectors: aligned pointers, and every row, tile edge and stride a whole number of vectors.
    auto aligned = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
    auto whole = [](int64_t x, int e) { return x % e == 0; };
    constexpr int EX = 16 / sizeof(T), EB = 16 / sizeof(TB);
    const bool vec_x = aligned(p.u) && aligned(p.delta) && aligned(q.dout) && aligned(p.z) && aligned(q.du) &&
                       aligned(q.ddelta) && aligned(q.dz) && whole(p.x_stride_batch, EX) &&
                       (time_contiguous ? whole(p.x_stride_dim, EX) && whole(L, EX)
                                        : p.x_stride_dim == 1 && whole(p.x_stride_seq, EX) && whole(group_dim, EX) && whole(CB, EX));
    const bool vec_bc = aligned(p.B) && aligned(p.C) && whole(p.bc_stride_batch, EB) && whole(p.bc_stride_group, EB) &&
                        (bc_time_contiguous ? whole(p.bc_stride_state, EB) && whole(L, EB)
                                            : p.bc_stride_state == 1 && whole(p.bc_stride_seq, EB) && whole(N, EB));
    const int64_t x_base = b * p.x_stride_batch + d0 * p.x_stride_dim;
    const int64_t bc_base = kVaryingBC ? b * p.bc_stride_batch + group * p.bc_stride_group : d * p.bc_stride_group;
    const bool softplus_on = p.delta_softplus != 0;
    // The next tile is copied ahead when the launch made room for it and it moves in whole vectors.
    const bool copy_ahead = shared_bytes >= base_bytes + Raw::kBytes && vec_x && (!kVaryingBC || vec_bc);
    const float skip = active && p.D ? p.D[d] : 0.f;

    bool valid[K];
    float a2[K], A[K], g[K], dA[K], b_inv[kVaryingBC ? 1 : K], c_inv[kVaryingBC ? 1 : K];
    float db_inv[kVaryingBC ? 1 : K], dc_inv[kVaryingBC ? 1 : K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int n = n0 + (k ^ perm);
        valid[k] = active && n < N;
        A[k] = valid[k] ? p.A[d * N + n] : 0.f;
        a2[k] = A[k] * kLog2e;
        if constexpr (kPacked) g[k] = 0.f;  // for the backward's rule at seqlen
        else g[k] = valid[k] && q.dfinal_state ? q.dfinal_state[(b * p.dim + d) * N + n] : 0.f;
        dA[k] = 0.f;
        if constexpr (!kVaryingBC) {
            b_inv[k] = valid[k] ? to_f32(B_g[bc_base + n * p.bc_stride_state]) : 0.f;
            c_inv[k] = valid[k] ? to_f32(C_g[bc_base + n * p.bc_stride_state]) : 0.f;
            db_inv[k] = dc_inv[k] = 0.f;
        }
    }
    float dD = 0.f, dbias = 0.f;

    // Stages a tile's per-(channel, step) inputs and B/C (zeros outside the tile), all of them or
    // (forward_only) what a forward pass reads: u, dt, B. Every global load is issued before the
    // first use, so that their latencies overlap: 16-byte vectors along the contiguous axis where
    // the shape allows it (vec_x, vec_bc), else single elements.
    auto stage_element = [&](int r, int t, bool in, float u, float x, float dout, float zv, bool forward_only) {
        // Outside the tile dt = 0 (decay 1, no input): the recompute may run past its end.
        const float e = softplus_on ? exp_neg_abs(x) : 0.f;  // softplus' derivative uses it too
        const float dt = !in ? 0.f : softplus_on ? softplus_from_t(x, e) : x;
        s_u[r * P + t] = u;
        s_dt[r * P + t] = dt;
        if (!forward_only) {
            const float s = sigmoid_fast(zv);
            s_sig[r * P + t] = softplus_on ? sigmoid_from_t(x, e) : 1.f;
            s_dy[r * P + t] = z_g ? dout * zv * s : dout;
            s_dzf[r * P + t] = z_g ? dout * s * (1.f + zv * (1.f - s)) : 0.f;
        }
    };
    // The tile that is being copied ahead (l0 < 0: none).
    int64_t ahead_l0 = -1;
    int ahead_steps = 0;
    auto copy_tile_ahead = [&](int64_t l0, int steps) {
        if (!copy_ahead) return;
        using Tile = VecTile<T, CB, S>;
        const T* xs[4] = {u_g, delta_g, dout_g, z_g};
        for (int v = tid; v < Tile::kCount; v += kBwdThreads) {
            int r, t;
            Tile::at(v, time_contiguous, r, t);
            const bool in = r < rows && t < steps;
            const int64_t xi = in ? x_base + r * p.x_stride_dim + (l0 + t) * p.x_stride_seq : 0;
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (xs[i]) cp_async16(raw + i * Raw::kX + v, xs[i] + xi, in);
        }
        if constexpr (kVaryingBC) {
            using BCTile = VecTile<TB, NMAX, S>;
            for (int v = tid; v < BCTile::kCount; v += kBwdThreads) {
                int n, t;
                BCTile::at(v, bc_time_contiguous, n, t);
                const bool in = n < N && t < steps;
                const int64_t gi = in ? bc_base + n * p.bc_stride_state + (l0 + t) * p.bc_stride_seq : 0;
                cp_async16(raw + 4 * Raw::kX + v, B_g + gi, in);
                cp_async16(raw + 4 * Raw::kX + Raw::kBC + v, C_g + gi, in);
            }
        }
        ahead_l0 = l0, ahead_steps = steps;
    };
    auto stage = [&](int64_t l0, int steps, bool forward_only) {
        // This thread's copies (each thread reads back only the vectors it copied).
        const bool from_raw = ahead_l0 == l0 && ahead_steps == steps;
        if (ahead_l0 >= 0) cp_async_wait_all();
        ahead_l0 = -1;
        if (vec_x) {
            using Tile = VecTile<T, CB, S>;
            constexpr int kVecs = (Tile::kCount + kBwdThreads - 1) / kBwdThreads, E = Tile::E;
            uint4 vu[kVecs], vdelta[kVecs], vdout[kVecs], vz[kVecs];
#pragma unroll
            for (int j = 0; j < kVecs; ++j) {
                int r, t;
                const bool in = Tile::at(j * kBwdThreads + tid, time_contiguous, r, t) && r < rows && t < steps;
                const int64_t xi = x_base + r * p.x_stride_dim + (l0 + t) * p.x_stride_seq;
                const uint4 zero = make_uint4(0, 0, 0, 0);
                const int v = j * kBwdThreads + tid;
                auto load = [&](const T* g, int i) {
                    if (from_raw) return v < Tile::kCount && g ? raw[i * Raw::kX + v] : zero;
                    return in && g ? __ldg(reinterpret_cast<const uint4*>(g + xi)) : zero;
                };
                vu[j] = load(u_g, 0);
                vdelta[j] = load(delta_g, 1);
                if (!forward_only) vdout[j] = load(dout_g, 2), vz[j] = load(z_g, 3);
            }
#pragma unroll
            for (int j = 0; j < kVecs; ++j) {
                int r0, t0;
                if (!Tile::at(j * kBwdThreads + tid, time_contiguous, r0, t0)) break;
                const bool in = r0 < rows && t0 < steps;  // whole vectors: the shape is a multiple of E
                const float* bias_row = in && p.delta_bias ? p.delta_bias + d0 + r0 : nullptr;
                const float bias0 = bias_row ? bias_row[0] : 0.f;
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    const int r = time_contiguous ? r0 : r0 + e, t = time_contiguous ? t0 + e : t0;
                    const float bias = time_contiguous || !bias_row ? bias0 : bias_row[e];
                    stage_element(r, t, in, Tile::get(vu[j], e), Tile::get(vdelta[j], e) + bias, Tile::get(vdout[j], e),
                                  Tile::get(vz[j], e), forward_only);
                }
            }
        } else {
            constexpr int kItems = (CB * S + kBwdThreads - 1) / kBwdThreads;
            T ru[kItems], rdelta[kItems], rz[kItems], rdout[kItems];
            float rbias[kItems];
#pragma unroll
            for (int j = 0; j < kItems; ++j) {
                const int i = j * kBwdThreads + tid;
                const int r = time_contiguous ? i / S : i % CB;
                const int t = time_contiguous ? i % S : i / CB;
                const bool in = i < CB * S && r < rows && t < steps;
                const int64_t xi = x_base + r * p.x_stride_dim + (l0 + t) * p.x_stride_seq;
                const T zero = from_f32<T>(0.f);
                ru[j] = in ? u_g[xi] : zero;
                rdelta[j] = in ? delta_g[xi] : zero;
                rbias[j] = in && p.delta_bias ? p.delta_bias[d0 + r] : 0.f;
                if (!forward_only) {
                    rdout[j] = in ? dout_g[xi] : zero;
                    rz[j] = in && z_g ? z_g[xi] : zero;
                }
            }
#pragma unroll
            for (int j = 0; j < kItems; ++j) {
                const int i = j * kBwdThreads + tid;
                const int r = time_contiguous ? i / S : i % CB;
                const int t = time_contiguous ? i % S : i / CB;
                if (CB * S % kBwdThreads != 0 && i >= CB * S) break;
                stage_element(r, t, r < rows && t < steps, to_f32(ru[j]), to_f32(rdelta[j]) + rbias[j], to_f32(rdout[j]),
                              to_f32(rz[j]), forward_only);
            }
        }
        if constexpr (kVaryingBC) {
            if (vec_bc) {
                using Tile = VecTile<TB, NMAX, S>;
                constexpr int E = Tile::E;
                for (int v = tid; v < Tile::kCount; v += kBwdThreads) {
                    int n0v, t0;
                    Tile::at(v, bc_time_contiguous, n0v, t0);
                    const bool in = n0v < N && t0 < steps;
                    const int64_t gi = bc_base + n0v * p.bc_stride_state + (l0 + t0) * p.bc_stride_seq;
                    const uint4 zero = make_uint4(0, 0, 0, 0);
                    const uint4 vb = from_raw ? raw[4 * Raw::kX + v] : in ? __ldg(reinterpret_cast<const uint4*>(B_g + gi)) : zero;
                    const uint4 vc = forward_only ? zero
                                     : from_raw ? raw[4 * Raw::kX + Raw::kBC + v]
                                     : in       ? __ldg(reinterpret_cast<const uint4*>(C_g + gi))
                                                : zero;
#pragma unroll
                    for (int e = 0; e < E; ++e) {
                        const int at = bc_swizzle<NMAX>(bc_time_contiguous ? (t0 + e) * NMAX + n0v : t0 * NMAX + n0v + e);
                        s_B[at] = Tile::get(vb, e);
                        if (!forward_only) s_C[at] = Tile::get(vc, e);
                    }
                }
            } else {
                for (int i = tid; i < S * NMAX; i += kBwdThreads) {
                    const int n = bc_time_contiguous ? i / S : i % NMAX;
                    const int t = bc_time_contiguous ? i % S : i / NMAX;
                    const bool in = n < N && t < steps;
                    const int64_t gi = bc_base + n * p.bc_stride_state + (l0 + t) * p.bc_stride_seq;
                    s_B[bc_swizzle<NMAX>(t * NMAX + n)] = in ? to_f32(B_g[gi]) : 0.f;
                    if (!forward_only) s_C[bc_swizzle<NMAX>(t * NMAX + n)] = in ? to_f32(C_g[gi]) : 0.f;
                }
            }
        }
    };
    // B[t] and C[t] for this thread's states, in its order (see state_perm).
    const int bc_row = n0;
    auto load_bc = [&](int t, float (&Bt)[K], float (&Ct)[K], bool with_c) {
        if constexpr (kVaryingBC) {
#pragma unroll
            for (int q4 = 0; q4 < K / 4; ++q4) {
                const int at = bc_swizzle<NMAX>(bc_row + t * NMAX + 4 * (q4 ^ (perm >> 2)));
                const float4 bv = *reinterpret_cast<const float4*>(s_B + at);
                Bt[4 * q4] = bv.x, Bt[4 * q4 + 1] = bv.y, Bt[4 * q4 + 2] = bv.z, Bt[4 * q4 + 3] = bv.w;
                if (with_c) {
                    const float4 cv = *reinterpret_cast<const float4*>(s_C + at);
                    Ct[4 * q4] = cv.x, Ct[4 * q4 + 1] = cv.y, Ct[4 * q4 + 2] = cv.z, Ct[4 * q4 + 3] = cv.w;
                }
            }
        } else {
#pragma unroll
            for (int k = 0; k < K; ++k) Bt[k] = b_inv[k], Ct[k] = c_inv[k];
        }
    };
    // h <- exp(dt A) h + dt B u for step t of the staged tile.
    auto step_forward = [&](int t, float (&h)[K]) {
        const float dt = s_dt[c * P + t], dtu = dt * s_u[c * P + t];
        float Bt[K], Ct[K];
        load_bc(t, Bt, Ct, false);
#pragma unroll
        for (int k = 0; k < K; ++k) h[k] = fmaf(ex2_ftz(dt * a2[k]), h[k], dtu * Bt[k]);
    };

    // Packed sequences. States and their gradients are (num_seqs, dim, dstate): row s * dim + d.
    static_assert(S == 32 && (S + 1) * 8 <= kBwdSeqTableBytes, "a tile's steps are the bits of a mask, its table fits");
    const BwdSeqs seqs{p.cu_seqlens, p.num_seqs, L};
    int64_t* const s_seq = reinterpret_cast<int64_t*>(reinterpret_cast<char*>(sm) + tile_bytes);
    auto seq_state = [&](int64_t s, int k) { return (s * p.dim + d) * N + n0 + (k ^ perm); };
    // The staged tile's boundaries, [s_lo, s_hi) (the first at or after its first step, and after its
    // last): s_seq[t] = the first at or after step t (t = 0..S; s_hi past the tile's steps), so that
    // step t crosses s_seq[t] .. s_seq[t + 1] - 1. Written between the barriers around the staging;
    // false (and nothing written) when there is none.
    auto find_boundaries = [&](int64_t l0, int steps, int64_t s_lo, int64_t s_hi) {
        if (s_hi > s_lo && tid <= S)
            s_seq[tid] = tid == 0 ? s_lo : tid >= steps ? s_hi : seqs.lower_bound(l0 + tid, s_lo, s_hi);
        return s_hi > s_lo;
    };
    // After the barrier: bit t set where step t crosses a boundary (block-uniform).
    auto boundary_mask = [&](int steps, bool any) -> uint32_t {
        if (!any) return 0u;
        return __ballot_sync(0xffffffffu, lane < steps && s_seq[lane + 1] > s_seq[lane]);
    };
    // The forward's rule before step t: h = the initial state of the last sequence starting there
    // (below num_seqs), or 0.
    auto start_state = [&](int t, float (&h)[K]) {
        const int64_t s = min(s_seq[t + 1], p.num_seqs) - 1;
        if (s < s_seq[t]) return;
#pragma unroll
        for (int k = 0; k < K; ++k) h[k] = valid[k] && p.initial_state ? p.initial_state[seq_state(s, k)] : 0.f;
    };
    // The backward's rule at a position, for its boundaries s = hi - 1 down to lo: the sequence
    // starting there takes g as its initial state's gradient (when `write`), then g becomes the
    // final-state cotangent of the one before (or 0). True when g was replaced.
    auto cross_back = [&](int64_t lo, int64_t hi, bool write) {
        bool replaced = false;
        for (int64_t s = hi - 1; s >= lo; --s) {
            if (write && s < p.num_seqs && q.dinitial_state) {
#pragma unroll
                for (int k = 0; k < K; ++k)
                    if (valid[k]) q.dinitial_state[seq_state(s, k)] = g[k];
            }
            if (s >= 1) {
#pragma unroll
                for (int k = 0; k < K; ++k) g[k] = valid[k] && q.dfinal_state ? q.dfinal_state[seq_state(s - 1, k)] : 0.f;
                replaced = true;
            }
        }
        return replaced;
    };

    // The workspace (BwdLayout in src/ops/selective_scan/mod.rs): dB and dC partials (per block and
    // step when time-varying, else per part and row), per-part-and-row dA, dD and ddelta_bias
    // partials, then the split's records [n_split - 1][batch][dim][dstate + 1].
    const int64_t n_split = p.n_chunks, z = blockIdx.z;
    float* dB_part = p.workspace;
    const int64_t bc_part = kVaryingBC ? p.batch * (p.dim / group_dim) * tiles_per_group * L * N : n_split * BD * N;
    float* dC_part = dB_part + bc_part;
    float* dA_part = dC_part + bc_part;
    float* dD_part = dA_part + n_split * BD * N;
    float* dbias_part = dD_part + n_split * BD;
    float* records = dbias_part + n_split * BD;
    // This block's rows of the time-varying dB/dC partials: [l][n].
    const int64_t block_part = ((b * (p.dim / group_dim) + group) * tiles_per_group + tile_in_group) * L * N;
    const int64_t row = b * p.dim + d;

    const int64_t n_checkpoints = checkpoint_count(p);
    const int64_t part_checkpoints = n_split > 1 ? p.chunk_len / p.checkpoint_len : n_checkpoints;
    const int64_t part = kLocal ? z + 1 : z;
    const int64_t ck_begin = part * part_checkpoints, ck_end = min(n_checkpoints, ck_begin + part_checkpoints);

    if constexpr (kLocal) {
        float dt_sum = 0.f;
        [[maybe_unused]] bool reset = false;  // packed: a boundary replaced g (the record says so by a NaN sum)
#pragma unroll
        for (int k = 0; k < K; ++k) g[k] = 0.f;  // the part's own contribution: no dfinal_state
        const int64_t l_begin = ck_begin * p.checkpoint_len, l_end = min(L, ck_end * p.checkpoint_len);
        // Packed: the first boundary at or after the end of the tile being walked.
        [[maybe_unused]] int64_t seq_end = kPacked ? seqs.lower_bound(l_end, 0, p.num_seqs + 1) : 0;
        for (int64_t l0 = l_begin + (l_end - l_begin - 1) / S * S; l0 >= l_begin; l0 -= S) {
            const int steps = int(min(int64_t(S), l_end - l0));
            __syncthreads();
            stage(l0, steps, false);
            [[maybe_unused]] bool any = false;
            if constexpr (kPacked) {
                const int64_t seq_begin = seqs.lower_bound_below(l0, seq_end);
                any = find_boundaries(l0, steps, seq_begin, seq_end);
                seq_end = seq_begin;
            }
            __syncthreads();
            if (l0 - S >= l_begin) copy_tile_ahead(l0 - S, S);
            bool walked = false;
            if constexpr (kPacked) {
                // A tile with a boundary: the steps with the backward's rule at their positions.
                if (const uint32_t mask = boundary_mask(steps, any)) {
                    for (int t = steps - 1; t >= 0; --t) {
                        const float dt = s_dt[c * P + t], dy = s_dy[c * P + t];
                        float Bt[K], Ct[K];
                        load_bc(t, Bt, Ct, true);
                        dt_sum += dt;
#pragma unroll
                        for (int k = 0; k < K; ++k) g[k] = ex2_ftz(dt * a2[k]) * fmaf(Ct[k], dy, g[k]);
                        if ((mask >> t) & 1u) reset |= cross_back(s_seq[t], s_seq[t + 1], false);
                    }
                    walked = true;
                }
            }
            if (!walked)
                for (int t = steps - 1; t >= 0; --t) {
                    const float dt = s_dt[c * P + t], dy = s_dy[c * P + t];
                    float Bt[K], Ct[K];
                    load_bc(t, Bt, Ct, true);
                    dt_sum += dt;
#pragma unroll
                    for (int k = 0; k < K; ++k) g[k] = ex2_ftz(dt * a2[k]) * fmaf(Ct[k], dy, g[k]);
                }
        }
        if (!active) return;
        float* record = records + ((part - 1) * BD + row) * (N + 1);
#pragma unroll
        for (int k = 0; k < K; ++k)
            if (valid[k]) record[n0 + (k ^ perm)] = g[k];
        if (thread_part == 0) record[N] = kPacked && reset ? __int_as_float(0x7fc00000) : dt_sum;
        return;
    }
    // g entering this part: dfinal_state (packed: the backward's rule at seqlen), carried through the
    // parts after it; past a part with a boundary (packed: a NaN sum), that part's own g alone.
    [[maybe_unused]] int64_t seq_end = 0;  // packed: the first boundary at or after the end of the chunk being walked
    if constexpr (kPacked) {
        // The sequences ending at seqlen, and the empty ones there (their rows written by the last part).
        const int64_t at_end = seqs.lower_bound(L, 0, p.num_seqs + 1);
        cross_back(at_end, p.num_seqs + 1, part == n_split - 1);
        seq_end = seqs.lower_bound(min(L, ck_end * p.checkpoint_len), 0, at_end);
    }
    for (int64_t j = n_split - 1; j > part; --j) {
        const float* record = records + ((j - 1) * BD + row) * (N + 1);
        if constexpr (kPacked) {
            const bool reset = isnan(record[N]);
#pragma unroll
            for (int k = 0; k < K; ++k)
                if (valid[k])
                    g[k] = reset ? record[n0 + (k ^ perm)] : fmaf(ex2_ftz(record[N] * a2[k]), g[k], record[n0 + (k ^ perm)]);
        } else {
#pragma unroll
            for (int k = 0; k < K; ++k)
                if (valid[k]) g[k] = fmaf(ex2_ftz(record[N] * a2[k]), g[k], record[n0 + (k ^ perm)]);
        }
    }

    const float* checkpoints = p.checkpoints + (b * p.dim + d) * n_checkpoints * N;
    bool checkpoint_ahead = false;  // this chunk's checkpoint copied into the first tile start's slot
    for (int64_t chunk = ck_end - 1; chunk >= ck_begin; --chunk) {
        const int64_t c_begin = chunk * p.checkpoint_len, c_end = min(L, c_begin + p.checkpoint_len);
        const int tiles = int((c_end - c_begin + S - 1) / S);
        float h[K];
        if (checkpoint_ahead) cp_async_wait_all();
#pragma unroll
        for (int k = 0; k < K; ++k)
            h[k] = checkpoint_ahead ? s_tile[k * kBwdThreads + tid] : valid[k] ? checkpoints[chunk * N + n0 + (k ^ perm)] : 0.f;
        checkpoint_ahead = false;
        // Packed: the chunk's boundaries are [seq_begin, seq_end); each tile finds its own among them.
        [[maybe_unused]] int64_t seq_begin = 0;
        if constexpr (kPacked) seq_begin = seqs.lower_bound_below(c_begin, seq_end);
        auto tile_boundaries = [&](int64_t l0, int steps) {
            return find_boundaries(l0, steps, seqs.lower_bound(l0, seq_begin, seq_end),
                                   seqs.lower_bound(l0 + steps, seq_begin, seq_end));
        };
        // The state entering each tile of the chunk (before the forward's rule at its first step,
        // as the checkpoints).
        for (int tile = 0; tile < tiles; ++tile) {
#pragma unroll
            for (int k = 0; k < K; ++k) s_tile[(tile * K + k) * kBwdThreads + tid] = h[k];
            if (tile == tiles - 1) break;
            const int64_t l0 = c_begin + int64_t(tile) * S;
            __syncthreads();
            stage(l0, S, true);
            [[maybe_unused]] bool any = false;
            if constexpr (kPacked) any = tile_boundaries(l0, S);
            __syncthreads();
            copy_tile_ahead(l0 + S, int(min(int64_t(S), c_end - l0 - S)));  // the next forward pass or the last tile
            if constexpr (kPacked) {
                if (const uint32_t mask = boundary_mask(S, any)) {
                    for (int t = 0; t < S; ++t) {
                        if ((mask >> t) & 1u) start_state(t, h);
                        step_forward(t, h);
                    }
                    continue;
                }
            }
            for (int t = 0; t < S; ++t) step_forward(t, h);
        }

        for (int tile = tiles - 1; tile >= 0; --tile) {
            const int64_t l0 = c_begin + int64_t(tile) * S;
            const int steps = int(min(int64_t(S), c_end - l0));
            __syncthreads();
            stage(l0, steps, false);
            [[maybe_unused]] bool any = false;
            if constexpr (kPacked) any = tile_boundaries(l0, steps);
            __syncthreads();
            // Packed: bit t where step t of the tile crosses a boundary.
            [[maybe_unused]] uint32_t mask = 0u;
            if constexpr (kPacked) mask = boundary_mask(steps, any);
            // What is staged next: the tile before, or the chunk before's first (its forward pass,
            // or its only tile; every chunk but the last is whole).
            if (tile > 0) copy_tile_ahead(l0 - S, S);
            else if (chunk > ck_begin) copy_tile_ahead(c_begin - p.checkpoint_len, S);
            // The state entering each piece of the tile (the last piece's steps lead nowhere), before
            // the forward's rule at its first step.
#pragma unroll
            for (int k = 0; k < K; ++k) h[k] = s_tile[(tile * K + k) * kBwdThreads + tid];
            bool started = false;
            if constexpr (kPacked) {
                if (mask) {  // with the forward's rule at the tile's boundaries
                    for (int piece = 0; piece * SUB < steps; ++piece) {
#pragma unroll
                        for (int k = 0; k < K; ++k) s_piece[(piece * K + k) * kBwdThreads + tid] = h[k];
                        if ((piece + 1) * SUB >= steps) break;
#pragma unroll
                        for (int i = 0; i < SUB; ++i) {
                            if ((mask >> (piece * SUB + i)) & 1u) start_state(piece * SUB + i, h);
                            step_forward(piece * SUB + i, h);
                        }
                    }
                    started = true;
                }
            }
            if (!started)
                for (int piece = 0; piece * SUB < steps; ++piece) {
#pragma unroll
                    for (int k = 0; k < K; ++k) s_piece[(piece * K + k) * kBwdThreads + tid] = h[k];
                    if ((piece + 1) * SUB >= steps) break;
#pragma unroll
                    for (int i = 0; i < SUB; ++i) step_forward(piece * SUB + i, h);
                }
            if (tile == 0 && chunk > ck_begin) {
                // The chunk before's checkpoint, into the slot read above (its values used since).
#pragma unroll
                for (int k = 0; k < K; ++k)
                    cp_async4(s_tile + k * kBwdThreads + tid, checkpoints + (valid[k] ? (chunk - 1) * N + n0 + (k ^ perm) : 0), valid[k]);
                checkpoint_ahead = true;
            }

            // The tile's pieces, last to first; kRules: with the rules at the boundaries in `mask`. Only a
            // packed tile with a boundary takes it: the others run the unpacked kernels' steps (their
            // per-step tests made the packed kernel ~20% slower: ncu, H200, 8 sequences in 16384 steps).
            auto walk_pieces = [&](auto rules) {
                constexpr bool kRules = decltype(rules)::value;
                for (int piece = (steps - 1) / SUB; piece >= 0; --piece) {
                    // Recompute the piece: decays and states of its steps, and y for dz.
                    float hs[K], hp[SUB][K], ap[SUB][K], y_part[SUB];
#pragma unroll
                    for (int k = 0; k < K; ++k) hs[k] = s_piece[(piece * K + k) * kBwdThreads + tid];
#pragma unroll
                    for (int i = 0; i < SUB; ++i) {
                        const int t = piece * SUB + i;  // steps past the tile's end have dt = u = 0: a = 1
                        const float dt = s_dt[c * P + t], u = s_u[c * P + t], dtu = dt * u;
                        float Bt[K], Ct[K];
                        load_bc(t, Bt, Ct, true);
                        float y2[2] = {0.f, 0.f};  // two sums: shorter dependency chains
                        // kRules: the state entering the step, after the forward's rule. (The rest
                        // keep their own expression: the copy changed their register allocation.)
                        float h_in[K];
                        if constexpr (kRules) {
#pragma unroll
                            for (int k = 0; k < K; ++k) h_in[k] = i ? hp[i - 1][k] : hs[k];
                            if ((mask >> t) & 1u) start_state(t, h_in);
                        }
#pragma unroll
                        for (int k = 0; k < K; ++k) {
                            ap[i][k] = ex2_ftz(dt * a2[k]);
                            hp[i][k] = fmaf(ap[i][k], kRules ? h_in[k] : i ? hp[i - 1][k] : hs[k], dtu * Bt[k]);
                            y2[k % 2] = fmaf(Ct[k], hp[i][k], y2[k % 2]);
                        }
                        y_part[i] = y2[0] + y2[1];
                    }
                    // dz's factor: y of each step, summed over the channel's threads, each finishing
                    // some steps (all have read the piece's u before the shuffles).
                    if (p.z) {
                        Sums::reduce(y_part, thread_part);
                        if (Sums::finisher(thread_part))
#pragma unroll
                            for (int e = 0; e < Sums::E; ++e) {
                                const int t = piece * SUB + first_step + e;
                                s_dzf[c * P + t] *= fmaf(skip, s_u[c * P + t], y_part[e]);
                            }
                    }
                    // The gradient recurrence over the piece, backwards. Per step, this thread's shares of
                    // sum_n A w and sum_n g B (for ddelta and du, finished after the piece). Steps past the
                    // tile's end (staged as zeros: dt = u = dy = 0, and time-varying B = C = 0) leave g,
                    // dA, dB and dC as they are, and their other sums are not written: no branch per step.
                    float ddt_part[SUB], gb_part[SUB];
                    // This warp's dB/dC rows for the piece's steps in the flush window.
                    float* const warp_sums = s_warp + (warp * Sh::FLUSH + (piece * SUB) % Sh::FLUSH) * 2 * NMAX + n0;
#pragma unroll
                    for (int i = SUB - 1; i >= 0; --i) {
                        const int t = piece * SUB + i;
                        const float dt = s_dt[c * P + t], u = s_u[c * P + t], dy = s_dy[c * P + t], dtu = dt * u;
                        float Bt[K], Ct[K], db[K], dc[K];
                        load_bc(t, Bt, Ct, true);
                        float ddt_a[2] = {0.f, 0.f}, gb2[2] = {0.f, 0.f};  // sum_n A w, sum_n g B
                        float h_in[K];  // kRules: h[l-1] after the forward's rule (reloaded, not kept)
                        if constexpr (kRules) {
#pragma unroll
                            for (int k = 0; k < K; ++k) h_in[k] = i ? hp[i - 1][k] : hs[k];
                            if ((mask >> t) & 1u) start_state(t, h_in);
                        }
#pragma unroll
                        for (int k = 0; k < K; ++k) {
                            const float gk = fmaf(Ct[k], dy, g[k]);
                            const float w = gk * ap[i][k] * (kRules ? h_in[k] : i ? hp[i - 1][k] : hs[k]);  // g a h[l-1]
                            ddt_a[k % 2] = fmaf(A[k], w, ddt_a[k % 2]);
                            gb2[k % 2] = fmaf(gk, Bt[k], gb2[k % 2]);
                            dA[k] = fmaf(w, dt, dA[k]);
                            db[k] = gk * dtu;
                            dc[k] = dy * hp[i][k];
                            g[k] = ap[i][k] * gk;
                        }
                        ddt_part[i] = ddt_a[0] + ddt_a[1];
                        gb_part[i] = gb2[0] + gb2[1];
                        if constexpr (kVaryingBC) {
                            bool writer;
                            int first;
                            const int count = reduce_scatter_channels<TPC>(db, lane, first, writer);
                            reduce_scatter_channels<TPC>(dc, lane, first, writer);
                            float* w = warp_sums + i * 2 * NMAX;
                            if (writer) {
#pragma unroll
                                for (int j = 0; j < 8; ++j) {
                                    if (j >= count) break;
                                    w[(first + j) ^ perm] = db[j];
                                    w[NMAX + ((first + j) ^ perm)] = dc[j];
                                }
                            }
                        } else {
#pragma unroll
                            for (int k = 0; k < K; ++k) db_inv[k] += db[k], dc_inv[k] += dc[k];
                        }
                        // The backward's rule at the step's position, g now being the gradient of the
                        // state entering it.
                        if constexpr (kRules)
                            if ((mask >> t) & 1u) cross_back(s_seq[t], s_seq[t + 1], true);
                    }
                    // ddt = sum_n g (B u + A a h[l-1]); du = dt sum_n g B + D dy: the sums over the
                    // channel's threads, each finishing some steps (all have read the piece's u and dt).
                    Sums::reduce(ddt_part, thread_part);
                    Sums::reduce(gb_part, thread_part);
                    if (Sums::finisher(thread_part) && active)
#pragma unroll
                        for (int e = 0; e < Sums::E; ++e) {
                            const int t = piece * SUB + first_step + e;
                            if (t >= steps) continue;
                            const float u = s_u[c * P + t], dt = s_dt[c * P + t], dy = s_dy[c * P + t];
                            const float ddelta = fmaf(u, gb_part[e], ddt_part[e]) * s_sig[c * P + t];
                            s_u[c * P + t] = fmaf(dt, gb_part[e], skip * dy);
                            s_dt[c * P + t] = ddelta;
                            dD = fmaf(dy, u, dD);
                            dbias += ddelta;
                        }
                    if constexpr (kVaryingBC) {
                        // After the first piece of a window: its dB/dC sums over the block's warps, in
                        // warp order, to the workspace.
                        constexpr int FL = Sh::FLUSH;
                        if ((piece * SUB) % FL == 0) {
                            __syncthreads();
                            // V states a thread: 4 (16-byte loads and stores) where the rows are 16-byte aligned.
                            auto flush = [&](auto states) {
                                constexpr int V = decltype(states)::value;
                                struct alignas(4 * V) Vec {
                                    float f[V];
                                };
                                for (int i = tid * V; i < FL * 2 * NMAX; i += kBwdThreads * V) {
                                    const int step = i / (2 * NMAX), which = (i / NMAX) % 2, n = i % NMAX;
                                    const int t = piece * SUB + step;
                                    if (n >= N || t >= steps) continue;
                                    Vec sum = {};
#pragma unroll
                                    for (int wi = 0; wi < kBwdWarps; ++wi) {
                                        const Vec v = *reinterpret_cast<const Vec*>(s_warp + ((wi * FL + step) * 2 + which) * NMAX + n);
#pragma unroll
                                        for (int e = 0; e < V; ++e) sum.f[e] += v.f[e];
                                    }
                                    *reinterpret_cast<Vec*>((which ? dC_part : dB_part) + block_part + (l0 + t) * N + n) = sum;
                                }
                            };
                            if (N % 4 == 0 && aligned(p.workspace)) flush(std::integral_constant<int, 4>{});
                            else flush(std::integral_constant<int, 1>{});
                            if (piece > 0) __syncthreads();  // before the next window overwrites the partials
                        }
                    }
                }
            };
            if constexpr (kPacked) {
                if (mask) walk_pieces(std::true_type{});
                else walk_pieces(std::false_type{});
            } else {
                walk_pieces(std::false_type{});
            }
            __syncthreads();
            // du, ddelta, dz of the tile.
            T* du_g = static_cast<T*>(q.du);
            T* ddelta_g = static_cast<T*>(q.ddelta);
            T* dz_g = static_cast<T*>(q.dz);
            if (vec_x) {
                using Tile = VecTile<T, CB, S>;
                for (int v = tid; v < Tile::kCount; v += kBwdThreads) {
                    int r0, t0;
                    Tile::at(v, time_contiguous, r0, t0);
                    if (r0 >= rows || t0 >= steps) continue;
                    const int64_t xi = x_base + r0 * p.x_stride_dim + (l0 + t0) * p.x_stride_seq;
                    const int at = r0 * P + t0, step = time_contiguous ? 1 : P;  // element e at at + e * step
                    *reinterpret_cast<uint4*>(du_g + xi) = Tile::pack(s_u + at, step);
                    *reinterpret_cast<uint4*>(ddelta_g + xi) = Tile::pack(s_dt + at, step);
                    if (dz_g) *reinterpret_cast<uint4*>(dz_g + xi) = Tile::pack(s_dzf + at, step);
                }
            } else {
                for (int i = tid; i < CB * S; i += kBwdThreads) {
                    const int r = time_contiguous ? i / S : i % CB;
                    const int t = time_contiguous ? i % S : i / CB;
                    if (r >= rows || t >= steps) continue;
                    const int64_t xi = x_base + r * p.x_stride_dim + (l0 + t) * p.x_stride_seq;
                    du_g[xi] = from_f32<T>(s_u[r * P + t]);
                    ddelta_g[xi] = from_f32<T>(s_dt[r * P + t]);
                    if (dz_g) dz_g[xi] = from_f32<T>(s_dzf[r * P + t]);
                }
            }
        }
        if constexpr (kPacked) seq_end = seq_begin;
    }

    // dD and ddelta_bias: each of the channel's first R threads summed its own steps.
#pragma unroll
    for (int o = 1; o < Sums::R; o *= 2) {
        dD += __shfl_xor_sync(0xffffffffu, dD, o);
        dbias += __shfl_xor_sync(0xffffffffu, dbias, o);
    }
    if (!active) return;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        if (!valid[k]) continue;
        const int64_t at = (z * BD + row) * N + n0 + (k ^ perm);
        dA_part[at] = dA[k];
        // (Packed: written by the backward's rule at each sequence's start.)
        if constexpr (!kPacked)
            if (q.dinitial_state && z == 0) q.dinitial_state[row * N + n0 + (k ^ perm)] = g[k];
        if constexpr (!kVaryingBC) {
            dB_part[at] = db_inv[k];
            dC_part[at] = dc_inv[k];
        }
    }
    if (thread_part == 0) dD_part[z * BD + row] = dD, dbias_part[z * BD + row] = dbias;
}

// The reductions take SelectiveScanBwdReduceParams (kernels/params.h).

// Sums the time-varying dB/dC partials over the tiles of each group, in tile order: one thread per
// (batch, group, step, state).
template <typename TB> __device__ __forceinline__ void selective_scan_bwd_reduce_bc(const SelectiveScanBwdReduceParams& r) {
    const SelectiveScanBwdParams& q = r.q;
    const SelectiveScanFwdParams& p = q.fwd;
    const int64_t N = p.dstate, L = p.seqlen, groups = r.groups;
    const int64_t total = p.batch * groups * L * N;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t n = i % N, l = (i / N) % L, bg = i / (N * L);  // bg = b * groups + group
        const int64_t b = bg / groups, group = bg % groups;
        const float* src = p.workspace + bg * r.tiles_per_group * L * N + l * N + n;
        float sb = 0.f, sc = 0.f;
        for (int64_t t = 0; t < r.tiles_per_group; ++t) sb += src[t * L * N], sc += src[r.bc_part + t * L * N];
        const int64_t at = b * p.bc_stride_batch + group * p.bc_stride_group + n * p.bc_stride_state + l * p.bc_stride_seq;
        static_cast<TB*>(q.dB)[at] = from_f32<TB>(sb);
        static_cast<TB*>(q.dC)[at] = from_f32<TB>(sc);
    }
}

// Sums the per-batch-row partials over the batch, in batch order: dA, dD, ddelta_bias, and
// time-invariant dB/dC. One thread per (channel, state) (per channel when dstate is 0).
template <typename TB>
__device__ __forceinline__ void selective_scan_bwd_reduce_params(const SelectiveScanBwdReduceParams& r) {
    const SelectiveScanBwdParams& q = r.q;
    const SelectiveScanFwdParams& p = q.fwd;
    const int64_t N = p.dstate, DN = p.dim * N, per_channel = N > 0 ? N : 1;
    const float* dB_part = p.workspace;
    const float* dC_part = dB_part + r.bc_part;
    const float* dA_part = dC_part + r.bc_part;
    const int64_t rows = p.n_chunks * p.batch;  // partials of every part of the sequence split and batch row
    const float* dD_part = dA_part + rows * p.dim * N;
    const float* dbias_part = dD_part + rows * p.dim;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.dim * per_channel;
         i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t d = i / per_channel, n = i % per_channel;
        if (n < N) {
            float sa = 0.f, sb = 0.f, sc = 0.f;
            for (int64_t b = 0; b < rows; ++b) {
                sa += dA_part[b * DN + i];
                if (!r.varying_bc) sb += dB_part[b * DN + i], sc += dC_part[b * DN + i];
            }
            q.dA[i] = sa;
            if (!r.varying_bc) {
                const int64_t at = d * p.bc_stride_group + n * p.bc_stride_state;
                static_cast<TB*>(q.dB)[at] = from_f32<TB>(sb);
                static_cast<TB*>(q.dC)[at] = from_f32<TB>(sc);
            }
        }
        if (n == 0) {
            float sd = 0.f, sbias = 0.f;
            for (int64_t b = 0; b < rows; ++b) sd += dD_part[b * p.dim + d], sbias += dbias_part[b * p.dim + d];
            if (q.dD) q.dD[d] = sd;
            if (q.ddelta_bias) q.ddelta_bias[d] = sbias;
        }
    }
}

// selective_scan_bwd_tiled[_local][_packed]_<T>_<TB>_tpc<TPC>_<varying|invariant>: kBwdThreads
// threads, a (blocks of channels, batch, parts of the split) grid (parts - 1 for _local),
// BwdShape<TPC> shared memory (the tile starts sized by the chunk's tiles; _packed: then
// kBwdSeqTableBytes).
#define SSB_TILED_ONE(NAME, T, TB, TPC, VARYING, LOCAL, PACKED)                                     \
    extern "C" __global__ void __launch_bounds__(kBwdThreads, 2) NAME(const SelectiveScanBwdParams q) { \
        selective_scan_bwd_tiled<T, TB, TPC, VARYING, LOCAL, PACKED>(q);                            \
    }
#define SSB_TILED_PASSES(T, TB, TPC, PASS, LOCAL, PACKED)                                                       \
    SSB_TILED_ONE(selective_scan_bwd_##PASS##_##T##_##TB##_tpc##TPC##_varying, T, TB, TPC, true, LOCAL, PACKED)    \
    SSB_TILED_ONE(selective_scan_bwd_##PASS##_##T##_##TB##_tpc##TPC##_invariant, T, TB, TPC, false, LOCAL, PACKED)
// A pass at every TPC (instantiated in selective_scan_bwd.cu and selective_scan_bwd_packed.cu).
#define SSB_TILED_TPCS(T, TB, PASS, LOCAL, PACKED)                                                            \
    SSB_TILED_PASSES(T, TB, 2, PASS, LOCAL, PACKED) SSB_TILED_PASSES(T, TB, 4, PASS, LOCAL, PACKED)           \
    SSB_TILED_PASSES(T, TB, 8, PASS, LOCAL, PACKED) SSB_TILED_PASSES(T, TB, 16, PASS, LOCAL, PACKED)          \
    SSB_TILED_PASSES(T, TB, 32, PASS, LOCAL, PACKED)
// selective_scan_bwd_reduce_{bc,params}_<TB>: any 1-D launch (grid-stride loops).
#define SSB_REDUCE(TB)                                                                                          \
    extern "C" __global__ void selective_scan_bwd_reduce_bc_##TB(const SelectiveScanBwdReduceParams r) {        \
        selective_scan_bwd_reduce_bc<TB>(r);                                                                   \
    }                                                                                                          \
    extern "C" __global__ void selective_scan_bwd_reduce_params_##TB(const SelectiveScanBwdReduceParams r) {    \
        selective_scan_bwd_reduce_params<TB>(r);                                                               \
    }

