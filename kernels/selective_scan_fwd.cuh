// Mamba-1 selective scan, forward (docs/selective_scan_fwd.md).
//
// Two kernels; src/cuda/selective_scan.rs picks one. `lanes` (any dstate up to 256): one channel
// (b, d) is scanned by NS consecutive lanes of a warp, each holding K = 8 of its states in registers;
// per step the lanes' partial <C, h> are summed with warp shuffles. `tiled` (below; any dstate, one
// B/C group per block, 16-byte rows) is the fast one. Layouts and the two forms of B/C are expressed
// through the parameter struct's strides.
#pragma once
#include <type_traits>

#include "selective_scan.cuh"

constexpr int kStatesPerLane = 8;
constexpr int kBlockThreads = 128;

// kPacked: packed sequences (cu_seqlens, batch 1; kernels/selective_scan.cuh, cross_boundaries).
template <typename T, typename TB, int NS, bool kPacked>
__device__ __forceinline__ void selective_scan_fwd_lanes(const SelectiveScanFwdParams& p) {
    constexpr int K = kStatesPerLane;
    const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t channels = p.batch * p.dim;
    const int slice = int(thread % NS);
    // Lanes past the last channel mirror it (they must still join the shuffles) but store nothing.
    const bool active = thread / NS < channels;
    const int64_t channel = active ? thread / NS : channels - 1;
    const int64_t b = channel / p.dim, d = channel % p.dim;

    float a2[K], h[K];  // A * log2(e), so exp(dt * A) = exp2(dt * a2)
    bool valid[K];
    const int64_t state0 = int64_t(slice) * K;
    const int64_t state_base = channel * p.dstate;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int64_t n = state0 + k;
        valid[k] = n < p.dstate;
        a2[k] = valid[k] ? p.A[d * p.dstate + n] * kLog2e : 0.f;
        // Packed: 0 (the rule at the first boundary sets it).
        h[k] = !kPacked && valid[k] && p.initial_state ? p.initial_state[state_base + n] : 0.f;
    }

    const T* u = static_cast<const T*>(p.u);
    const T* delta = static_cast<const T*>(p.delta);
    const T* z = static_cast<const T*>(p.z);
    T* out = static_cast<T*>(p.out);
    const TB* Bm = static_cast<const TB*>(p.B);
    const TB* Cm = static_cast<const TB*>(p.C);
    const int64_t x_base = b * p.x_stride_batch + d * p.x_stride_dim;
    const int64_t bc_base = b * p.bc_stride_batch + (d / p.dim_per_group) * p.bc_stride_group +
                            state0 * p.bc_stride_state;
    const float bias = p.delta_bias ? p.delta_bias[d] : 0.f;
    const float skip = p.D ? p.D[d] : 0.f;

    // Checkpoints for the backward pass: the state entering every checkpoint_len-th step (packed:
    // before the boundary rule there).
    float* checkpoint = p.checkpoints ? p.checkpoints + channel * checkpoint_count(p) * p.dstate + state0 : nullptr;
    int64_t next_checkpoint = 0;
    auto store_checkpoint = [&] {
        if (active) {
#pragma unroll
            for (int k = 0; k < K; ++k)
                if (valid[k]) checkpoint[k] = h[k];
        }
        checkpoint += p.dstate;
        next_checkpoint += p.checkpoint_len;
    };
    // Packed: the rule at a boundary on this channel's rows of final_state and initial_state,
    // (num_seqs, dim, dstate) (batch 1: state_base = d * dstate). The step loop tests one position a
    // step, the next checkpoint's or boundary's, whichever comes first (INT64_MAX: none).
    auto end_seq = [&](int64_t s) {
        if (!active) return;
#pragma unroll
        for (int k = 0; k < K; ++k)
            if (valid[k]) p.final_state[state_base + s * p.dim * p.dstate + state0 + k] = h[k];
    };
    auto start_seq = [&](int64_t s) {
#pragma unroll
        for (int k = 0; k < K; ++k)
            h[k] = valid[k] && p.initial_state ? p.initial_state[state_base + s * p.dim * p.dstate + state0 + k] : 0.f;
    };
    [[maybe_unused]] int64_t seq = 0, next_boundary = 0, next_event = 0;
    if constexpr (kPacked) {
        if (!checkpoint) next_checkpoint = INT64_MAX;
        next_boundary = seq_boundary(p, 0);
        next_event = min(next_checkpoint, next_boundary);
    }
#pragma unroll 4
    for (int64_t l = 0; l < p.seqlen; ++l) {
        if constexpr (kPacked) {
            if (l == next_event) {
                if (l == next_checkpoint) store_checkpoint();
                if (l == next_boundary) next_boundary = cross_boundaries(p, seq, l, end_seq, start_seq);
                next_event = min(next_checkpoint, next_boundary);
            }
        } else if (checkpoint && l == next_checkpoint) {
            store_checkpoint();
        }
        const int64_t xi = x_base + l * p.x_stride_seq;
        const float ul = to_f32(u[xi]);
        float dt = to_f32(delta[xi]) + bias;
        if (p.delta_softplus) dt = softplus(dt);
        const float dtu = dt * ul;
        const int64_t bci = bc_base + l * p.bc_stride_seq;
        float y = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (valid[k]) {
                const float bk = to_f32(Bm[bci + k * p.bc_stride_state]);
                const float ck = to_f32(Cm[bci + k * p.bc_stride_state]);
                h[k] = ex2_ftz(dt * a2[k]) * h[k] + bk * dtu;
                y += ck * h[k];
            }
        }
#pragma unroll
        for (int offset = NS / 2; offset > 0; offset /= 2) y += __shfl_xor_sync(0xffffffffu, y, offset);
        if (active && slice == 0) {
            y += skip * ul;
            if (z) y *= silu(to_f32(z[xi]));
            out[xi] = from_f32<T>(y);
        }
    }
    if constexpr (kPacked) {
        // The sequences that end at seqlen, and empty ones there.
        cross_boundaries(p, seq, p.seqlen, end_seq, start_seq);
    } else if (active) {
#pragma unroll
        for (int k = 0; k < K; ++k)
            if (valid[k]) p.final_state[state_base + state0 + k] = h[k];
    }
}

// extern "C" entry points, named selective_scan_fwd_lanes[_packed]_<T>_<TB>_ns<NS> (the Rust launcher
// builds the name): SSF_LANES(T, TB, lanes, false) or (T, TB, lanes_packed, true) defines them for
// every NS (instantiated in selective_scan_fwd.cu and selective_scan_fwd_packed.cu).
#define SSF_LANES_NS(T, TB, NS, NAME, PACKED)                                                  \
    extern "C" __global__ void __launch_bounds__(kBlockThreads)                                \
        selective_scan_fwd_##NAME##_##T##_##TB##_ns##NS(const SelectiveScanFwdParams p) {      \
        selective_scan_fwd_lanes<T, TB, NS, PACKED>(p);                                        \
    }
#define SSF_LANES(T, TB, NAME, PACKED)                                                                             \
    SSF_LANES_NS(T, TB, 1, NAME, PACKED) SSF_LANES_NS(T, TB, 2, NAME, PACKED) SSF_LANES_NS(T, TB, 4, NAME, PACKED) \
    SSF_LANES_NS(T, TB, 8, NAME, PACKED) SSF_LANES_NS(T, TB, 16, NAME, PACKED) SSF_LANES_NS(T, TB, 32, NAME, PACKED)

// ---------------------------------------------------------------------------------------------
// Tiled kernel. A block scans 64 channels of one batch row (32 and 16 from dstate 65 on) with TPC
// threads per channel (2, 4, 8, 16 or 32: dstate <= 16, 32, 64, 128, 256), each holding 8 of its
// states in registers, so the per-element work is the recurrence alone. The channel's threads sum
// their partial outputs a group of steps at a time, by reduce-scatter: each shuffles about one value
// per step and writes one step of the group (rather than log2(TPC) shuffles a step, and one thread
// writing). The sequence goes through in tiles of S steps: u, delta and z pass through shared
// memory (coalesced 16-byte global accesses in either layout; the next tile's loads are in flight in
// registers while this one is computed), dt = softplus(delta + bias) and the gate silu(z) are
// computed once per tile for all its steps (the independent work, off the recurrence's critical
// path), and B/C (one group per block) are staged as f32 and read by broadcast. Per-thread work is
// the same at every TPC: a larger dstate means more threads per block (128, 256, 512), not more
// registers; past 512 threads, fewer channels.
// TPC 1 (dstate <= 16, where the grid is large enough: cuda.rs): one thread holds a channel's 16
// states, so nothing is reduced, and u / dt loads are shared by twice the states (15% fewer
// instructions); dt and the gate are then computed in the step loop, not once per tile.

// Channels per block up to dstate 64: 64 (four blocks per SM at two threads per channel, 128
// registers a thread) ran 1-20% faster than 128 (two per SM) at every shape measured, channel-last
// most; 32 at one thread a channel was slower too (BENCHMARKS.md, "What did not pay").
constexpr int kTileChannels = 64;
// Blocks of 128 threads per SM the registers must allow (the launch bounds below).
constexpr int kMinBlocks = 4;
// Outputs are finished a group of G = min(TPC, kMaxStepGroup) steps at a time: the channel's threads
// reduce-scatter the group's partial sums, and each writes one step (rather than every thread
// summing every step and one of them writing it). Groups of 16 hold 16 partials a thread and lose.
constexpr int kMaxStepGroup = 8;
// At one thread a channel (no reduce), outputs are finished 4 steps at a time: 8 ran 0.5% faster
// but spills 4 bytes where B/C are staged element by element; 2 ran 3-15% slower.
constexpr int kSoloStepGroup = 4;
// Steps per batch of the per-tile scalars (softplus, silu) a thread computes as straight-line code
// (4 and 16 measured the same as 8).
constexpr int kScalarBatch = 8;
// Largest block: 512 threads at 128 registers fill an SM's register file.
constexpr int kTiledMaxThreads = 512;

// Threads per channel TPC: states per channel, channels and threads per block. 8 states a thread,
// 16 at TPC 1. From TPC 16 (dstate > 64) a block holds fewer channels (32 or 16), so that it stays
// at 512 threads.
template <int TPC> struct Tiled {
    static constexpr int kThreadStates = TPC == 1 ? 16 : 8;
    static constexpr int kStates = kThreadStates * TPC;  // largest dstate
    static constexpr int kChannels = kTileChannels * TPC <= kTiledMaxThreads ? kTileChannels : kTiledMaxThreads / TPC;
    static constexpr int kThreads = kChannels * TPC;
    // Floats per (chunk, batch, channel) in the workspace: the chunk's end state from zero, then its
    // sum of dt (which gives the chunk's decay of an incoming state, exp(A * sum dt)). Packed: a chunk
    // that crosses a boundary starts again from the initial state there, and its sum is NaN ("reset":
    // no incoming state reaches its end).
    static constexpr int kChunkRecord = kStates + 1;
};

// S steps per tile (64 bytes of a row), and row pitches of an odd number of 4-byte words, so that
// threads reading one step of different rows hit different banks.
template <typename T, int TPC> struct Tile {
    static constexpr int kSteps = 64 / sizeof(T);
    static constexpr int kPitch = kSteps + 4 / sizeof(T);  // elements of T: 17 words
    static constexpr int kPitchF32 = kSteps + 1;           // f32 rows
    static constexpr int kVecElems = 16 / sizeof(T);       // per 16-byte vector
    static constexpr int kChannels = Tiled<TPC>::kChannels;
    static constexpr int kVecs = kChannels * kSteps / kVecElems;  // per tensor tile
    static constexpr int kThreads = Tiled<TPC>::kThreads;
    static constexpr int kVecsPerThread = (kVecs + kThreads - 1) / kThreads;  // 2, 1, 1, ... (from TPC 8: not all threads)
    // Dynamic shared memory: u (then out), delta, z tiles; f32 dt and gate; f32 B and C.
    static constexpr int kSharedBytes = 3 * kChannels * kPitch * sizeof(T) + 2 * kChannels * kPitchF32 * 4 +
                                        2 * kSteps * Tiled<TPC>::kStates * 4;
};

// Where thread `i` reads and writes its share of a [channels x S steps] tile, as vectors of
// E = 16 / sizeof(T) elements along the contiguous axis: with time contiguous ("bdl") vector v covers
// steps (v % (S/E)) * E .. + E of row v / (S/E); with channels contiguous ("bld") it covers rows
// (v % (C/E)) * E .. + E at step v / (C/E), C = Tiled<TPC>::kChannels. v = k * threads + i; a v past
// the tile gets row C (outside every tile's rows: never loaded or stored). `offset` is the vector's
// place in global memory from the tile's first element (the same for u, delta, z and out), computed
// once: from scratch every tile, the 64-bit address arithmetic took ~100 instructions a tile.
template <typename T, int TPC> struct TileMap {
    using Tl = Tile<T, TPC>;
    static constexpr int S = Tl::kSteps, E = Tl::kVecElems, C = Tl::kChannels;
    int row[Tl::kVecsPerThread], t[Tl::kVecsPerThread];
    int64_t offset[Tl::kVecsPerThread];
    __device__ __forceinline__ TileMap(const SelectiveScanFwdParams& p, bool time_contiguous) {
#pragma unroll
        for (int k = 0; k < Tl::kVecsPerThread; ++k) {
            const int v = k * Tl::kThreads + threadIdx.x;
            row[k] = time_contiguous ? v / (S / E) : (v % (C / E)) * E;
            t[k] = time_contiguous ? (v % (S / E)) * E : v / (C / E);
            if (Tl::kVecs % Tl::kThreads != 0 && v >= Tl::kVecs) row[k] = C, t[k] = 0;
            offset[k] = row[k] * p.x_stride_dim + t[k] * p.x_stride_seq;
        }
    }
    // Whether vector k lies inside a tile of `rows` channels and `steps` steps.
    __device__ __forceinline__ bool inside(int k, int rows, int steps) const { return row[k] < rows && t[k] < steps; }
};

// One tensor's tile in flight: vectors loaded from global memory, later unpacked into shared memory.
template <typename T, int TPC> struct TileRegs {
    using Tl = Tile<T, TPC>;
    uint4 v[Tl::kVecsPerThread];

    // `tile`: the tile's first element.
    __device__ __forceinline__ void load(const T* tile, const TileMap<T, TPC>& m, int rows, int steps) {
#pragma unroll
        for (int k = 0; k < Tl::kVecsPerThread; ++k)
            v[k] = m.inside(k, rows, steps) ? __ldg(reinterpret_cast<const uint4*>(tile + m.offset[k])) : make_uint4(0, 0, 0, 0);
    }

    // Unpacks into tile[row * P + t]: whole 4-byte words along the steps (time contiguous), else
    // single elements down the rows.
    __device__ __forceinline__ void store_shared(T* tile, const TileMap<T, TPC>& m, bool time_contiguous) const {
        constexpr int P = Tl::kPitch, E = Tl::kVecElems;
#pragma unroll
        for (int k = 0; k < Tl::kVecsPerThread; ++k) {
            if (Tl::kVecs % Tl::kThreads != 0 && m.row[k] >= Tl::kChannels) continue;  // past the tile
            if (time_contiguous) {
                uint32_t* w = reinterpret_cast<uint32_t*>(tile + m.row[k] * P + m.t[k]);
                w[0] = v[k].x, w[1] = v[k].y, w[2] = v[k].z, w[3] = v[k].w;
            } else {
                const T* e = reinterpret_cast<const T*>(&v[k]);
#pragma unroll
                for (int j = 0; j < E; ++j) tile[(m.row[k] + j) * P + m.t[k]] = e[j];
            }
        }
    }
};

// Writes the output tile from shared memory with 16-byte global stores (`tile_out`: the tile's
// first element in global memory).
template <typename T, int TPC>
__device__ __forceinline__ void store_tile(T* tile_out, const T* tile, const TileMap<T, TPC>& m, bool time_contiguous,
                                           int rows, int steps) {
    constexpr int P = Tile<T, TPC>::kPitch, E = Tile<T, TPC>::kVecElems;
#pragma unroll
    for (int k = 0; k < Tile<T, TPC>::kVecsPerThread; ++k) {
        if (!m.inside(k, rows, steps)) continue;
        uint4 v;
        if (time_contiguous) {
            const uint32_t* w = reinterpret_cast<const uint32_t*>(tile + m.row[k] * P + m.t[k]);
            v = make_uint4(w[0], w[1], w[2], w[3]);
        } else {
            T* e = reinterpret_cast<T*>(&v);
#pragma unroll
            for (int j = 0; j < E; ++j) e[j] = tile[(m.row[k] + j) * P + m.t[k]];
        }
        // Through the intrinsic: a plain uint4 store here compiled to four 4-byte stores.
        __stcg(reinterpret_cast<uint4*>(tile_out + m.offset[k]), v);
    }
}

// How B and C reach the tiled kernel: one (dstate) row per channel (time-invariant), or per step,
// staged into shared memory as f32 rows [S][N] a tile ahead: element by element (any strides), or
// (kVaryingVec) as 16-byte vectors along their contiguous axis (16-byte aligned, rows a whole number
// of vectors). Rows along time ("bdl") staged element by element put a warp's writes N floats apart
// (16- to 32-way bank conflicts); as vectors, a warp's threads take consecutive states, a column each,
// and write to 32 banks. Rows along the states ("bld") conflict in neither form; there vectors pay
// only from dstate 65 on (src/cuda/selective_scan.rs picks).
enum class BcForm { kInvariant, kVarying, kVaryingVec };

template <typename TB, int N, int S, int kThreads, BcForm F> struct BcTileRegs {
    static constexpr int kVec = F == BcForm::kVaryingVec ? 16 / sizeof(TB) : 1;  // elements per item
    static constexpr int kItems = N * S / kVec;
    static constexpr int kPerThread = F == BcForm::kInvariant ? 1 : (kItems + kThreads - 1) / kThreads;
    using Item = std::conditional_t<F == BcForm::kVaryingVec, uint4, TB>;
    Item b[kPerThread], c[kPerThread];

    // Item k of this thread: its first state n and step t; false past the tile's items.
    __device__ __forceinline__ static bool where(int k, bool time_contiguous, int& n, int& t) {
        const int i = k * kThreads + threadIdx.x;
        if constexpr (F == BcForm::kVaryingVec) {
            // Along time: a warp's threads take consecutive states (a column each). Along the
            // states: consecutive vectors of one step.
            n = time_contiguous ? i % N : i % (N / kVec) * kVec;
            t = time_contiguous ? i / N * kVec : i / (N / kVec);
        } else {  // coalesced along the contiguous axis
            n = time_contiguous ? i / S : i % N;
            t = time_contiguous ? i % S : i / N;
        }
        return kItems % kThreads == 0 || i < kItems;
    }

    __device__ __forceinline__ void load(const TB* Bm, const TB* Cm, const SelectiveScanFwdParams& p, int64_t base,
                                         int64_t l0, int steps, bool time_contiguous) {
#pragma unroll
        for (int k = 0; k < kPerThread; ++k) {
            int n, t;
            const bool in = where(k, time_contiguous, n, t) && n < p.dstate && t < steps;
            const int64_t g = base + n * p.bc_stride_state + (l0 + t) * p.bc_stride_seq;
            if constexpr (F == BcForm::kVaryingVec) {
                b[k] = in ? __ldg(reinterpret_cast<const uint4*>(Bm + g)) : make_uint4(0, 0, 0, 0);
                c[k] = in ? __ldg(reinterpret_cast<const uint4*>(Cm + g)) : make_uint4(0, 0, 0, 0);
            } else {
                b[k] = in ? Bm[g] : from_f32<TB>(0.f);
                c[k] = in ? Cm[g] : from_f32<TB>(0.f);
            }
        }
    }

    __device__ __forceinline__ void store_shared(float* s_B, float* s_C, bool time_contiguous) const {
#pragma unroll
        for (int k = 0; k < kPerThread; ++k) {
            int n, t;
            if (!where(k, time_contiguous, n, t)) break;
            if constexpr (F == BcForm::kVaryingVec) {
                const TB* bk = reinterpret_cast<const TB*>(&b[k]);
                const TB* ck = reinterpret_cast<const TB*>(&c[k]);
                const int step = time_contiguous ? N : 1;  // from one element to the next
#pragma unroll
                for (int j = 0; j < kVec; ++j) {
                    s_B[bc_swizzle<N>(t * N + n + j * step)] = to_f32(bk[j]);
                    s_C[bc_swizzle<N>(t * N + n + j * step)] = to_f32(ck[j]);
                }
            } else {
                s_B[bc_swizzle<N>(t * N + n)] = to_f32(b[k]);
                s_C[bc_swizzle<N>(t * N + n)] = to_f32(c[k]);
            }
        }
    }
};

// Packed sequences: the next boundary a block has to cross, an index into cu_seqlens and its
// position (INT64_MAX: none).
struct SeqCursor {
    int64_t seq, at;
};
// A tile with a boundary in it: the tile step of the next one, and cross(step), which applies the
// rule there and returns the tile step of the one after it (the tile's steps: none left).
template <typename F> struct BoundaryTile {
    int next_step;
    F cross;
};

// kLocal: the first pass of a sequence split. Block (tile, b, chunk) scans its chunk from a zero
// state and records only the end state and the sum of dt. Otherwise the block starts from the
// initial state carried through the records of the chunks before it, and writes the output
// (one chunk covering the whole sequence when there is no split).
// kPacked: packed sequences (cu_seqlens, batch 1). Every channel of a block crosses the same
// boundaries, so their tests are block-uniform, and made a tile at a time: only a tile with a
// boundary in it runs a step loop that tests each step (kernels/selective_scan.cuh,
// cross_boundaries, for the rule).
template <typename T, typename TB, int TPC, BcForm kBC, bool kLocal, bool kPacked>
__device__ __forceinline__ void selective_scan_fwd_tiled(const SelectiveScanFwdParams& p) {
    constexpr bool kVaryingBC = kBC != BcForm::kInvariant;
    using Tl = Tile<T, TPC>;
    constexpr int N = Tiled<TPC>::kStates, K = Tiled<TPC>::kThreadStates, S = Tl::kSteps, P = Tl::kPitch, PF = Tl::kPitchF32;
    constexpr int kThreads = Tiled<TPC>::kThreads, kChunkRecord = Tiled<TPC>::kChunkRecord;
    constexpr int kChannels = Tiled<TPC>::kChannels;
    constexpr int G = TPC == 1 ? kSoloStepGroup : TPC < kMaxStepGroup ? TPC : kMaxStepGroup;  // steps a thread finishes: G / TPC
    using Sums = StepSums<TPC, G>;
    static_assert(S % G == 0, "output groups tile the steps");
    // One thread a channel computes dt and the gate step by step (a per-tile phase would leave each
    // thread walking its channel's steps alone, at two warps a scheduler: BENCHMARKS.md, "What did
    // not pay").
    constexpr bool kInline = TPC == 1;
    extern __shared__ __align__(16) unsigned char shared[];
    float* s_B = reinterpret_cast<float*>(shared);  // [S][N]
    float* s_C = s_B + S * N;
    float* s_dtf = s_C + S * N;                     // [channels][PF]: dt
    constexpr int kGateRows = kChannels * PF;    // from a dt row to the same channel's gate row
    float* s_gate = s_dtf + kGateRows;           // [channels][PF]: silu(z), or 1
    T* s_u = reinterpret_cast<T*>(s_gate + kChannels * PF);  // [channels][P]: u in, out back
    T* s_delta = s_u + kChannels * P;
    T* s_z = s_delta + kChannels * P;

    const int c = threadIdx.x / TPC;  // channel in the tile
    const int part = threadIdx.x % TPC;
    const int n0 = part * K;  // first of this thread's states
    const int64_t b = blockIdx.y;
    const int64_t d0 = int64_t(blockIdx.x) * kChannels;
    const int64_t d = d0 + c;
    const int rows = int(min(int64_t(kChannels), p.dim - d0));
    const bool active = c < rows;
    const int64_t state_base = (b * p.dim + d) * p.dstate;
    const TB* Bm = static_cast<const TB*>(p.B);
    const TB* Cm = static_cast<const TB*>(p.C);
    // Time-varying B/C: the block's one group; time-invariant: this channel's row.
    const int64_t bc_base = kVaryingBC ? b * p.bc_stride_batch + (d0 / p.dim_per_group) * p.bc_stride_group
                                       : d * p.bc_stride_group;

    const int64_t chunk = blockIdx.z;
    const int64_t l_begin = chunk * p.chunk_len, l_end = min(p.seqlen, l_begin + p.chunk_len);
    float* record = p.workspace + (chunk * p.batch * p.dim + b * p.dim + d) * kChunkRecord;
    const int64_t record_stride = p.batch * p.dim * kChunkRecord;  // from one chunk to the next

    float a2[K], h[K], b_inv[kVaryingBC ? 1 : K], c_inv[kVaryingBC ? 1 : K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int n = n0 + k;
        const bool valid = active && n < p.dstate;
        a2[k] = valid ? p.A[d * p.dstate + n] * kLog2e : 0.f;
        // Packed: 0 (the rule at the first boundary sets it).
        h[k] = !kLocal && !kPacked && valid && p.initial_state ? p.initial_state[state_base + n] : 0.f;
        if constexpr (!kVaryingBC) {
            b_inv[k] = valid ? to_f32(Bm[bc_base + n * p.bc_stride_state]) : 0.f;
            c_inv[k] = valid ? to_f32(Cm[bc_base + n * p.bc_stride_state]) : 0.f;
        }
    }
    if (!kLocal && active) {
        // Carry the state through the chunks before this one: h = exp(A * sum dt) * h + end state;
        // past a chunk that crossed a boundary (packed: a NaN sum), its end state alone.
        const float* prior = p.workspace + (b * p.dim + d) * kChunkRecord;
        for (int64_t j = 0; j < chunk; ++j, prior += record_stride) {
            const float dt_sum = prior[N];
            if constexpr (kPacked) {
                const bool reset = isnan(dt_sum);
#pragma unroll
                for (int k = 0; k < K; ++k) h[k] = reset ? prior[n0 + k] : fmaf(ex2_ftz(dt_sum * a2[k]), h[k], prior[n0 + k]);
            } else {
#pragma unroll
                for (int k = 0; k < K; ++k) h[k] = fmaf(ex2_ftz(dt_sum * a2[k]), h[k], prior[n0 + k]);
            }
        }
    }
    const float bias = active && p.delta_bias ? p.delta_bias[d] : 0.f;
    const float skip = active && p.D ? p.D[d] : 0.f;
    const bool has_z = !kLocal && p.z != nullptr;
    const bool time_contiguous = p.x_stride_seq == 1;
    const bool bc_time_contiguous = p.bc_stride_seq == 1;
    const int64_t x_base = b * p.x_stride_batch + d0 * p.x_stride_dim;
    const T* u = static_cast<const T*>(p.u);
    const T* delta = static_cast<const T*>(p.delta);
    const T* z = static_cast<const T*>(p.z);
    T* out = static_cast<T*>(p.out);
    const TileMap<T, TPC> map(p, time_contiguous);

    // The next tile, in flight while the current one is computed.
    TileRegs<T, TPC> next_u, next_delta, next_z;
    BcTileRegs<TB, N, S, kThreads, kBC> next_bc;
    auto fetch = [&](int64_t l0) {
        const int steps = int(min(int64_t(S), l_end - l0));
        const int64_t at = x_base + l0 * p.x_stride_seq;  // the tile's first element
        next_u.load(u + at, map, rows, steps);
        next_delta.load(delta + at, map, rows, steps);
        if (has_z) next_z.load(z + at, map, rows, steps);
        if constexpr (kVaryingBC) next_bc.load(Bm, Cm, p, bc_base, l0, steps, bc_time_contiguous);
    };

    // The next checkpoint's step and row, advanced as tiles reach them (a 64-bit division a tile
    // cost more than the stores).
    int64_t checkpoint_step = -1;
    float* checkpoint = nullptr;
    if (!kLocal && p.checkpoints) {
        const int64_t first = (l_begin + p.checkpoint_len - 1) / p.checkpoint_len;
        checkpoint_step = first * p.checkpoint_len;
        checkpoint = p.checkpoints + ((b * p.dim + d) * checkpoint_count(p) + first) * p.dstate;
    }
    const int64_t checkpoint_channel_stride = checkpoint_count(p) * p.dstate;  // floats
    // 16-byte stores: whole rows (dstate N: 64-byte aligned in an aligned buffer).
    const bool checkpoint_vectors = p.dstate == N && (reinterpret_cast<uintptr_t>(p.checkpoints) & 15) == 0;
    // At one thread a channel, through the scalar rows (s_dtf, s_gate), which it does not use. (At
    // TPC 2, through those rows between the last barrier and the scalar phase: the checkpoints cost
    // about the same, and the kernel without them 4.5% more, at 16x1536x2048 on the H100.)
    constexpr bool kCheckpointsViaShared = kInline;
    static_assert(!kCheckpointsViaShared || kThreads * (K + 4) <= 2 * kChannels * PF, "a warp's rows fit");

    float dt_sum = 0.f;
    // Packed: the rule at position l for the boundaries at or before it, from index `seq` on (the
    // first at or after l, searched from `from`). The final pass writes the ending sequences' final
    // states; both passes restart h from the next one's initial state, and the local pass marks its
    // record "reset" (a NaN sum of dt: the fold then takes the record's state alone). Returns the
    // next boundary's position.
    auto apply_rule = [&](int64_t l, int64_t from) {
        int64_t seq = first_boundary_at_or_after(p, l, from);
        return cross_boundaries(
            p, seq, l,
            [&](int64_t s) {
                if constexpr (!kLocal) {
                    if (!active) return;
#pragma unroll
                    for (int k = 0; k < K; ++k)
                        if (n0 + k < p.dstate) p.final_state[state_base + s * p.dim * p.dstate + n0 + k] = h[k];
                }
            },
            [&](int64_t s) {
#pragma unroll
                for (int k = 0; k < K; ++k)
                    h[k] = active && n0 + k < p.dstate && p.initial_state
                               ? p.initial_state[state_base + s * p.dim * p.dstate + n0 + k]
                               : 0.f;
                if constexpr (kLocal) dt_sum = __int_as_float(0x7fc00000);
            });
    };
    // Packed: the block's next boundary at each tile's start lives in shared memory, not registers,
    // so that the tiles without one keep the registers of the unpacked kernel (most of these
    // kernels sit at their cap). Two slots by tile parity: tile t reads slot t % 2, and thread 0
    // writes the next tile's in the other while the rest may still read this one's.
    __shared__ SeqCursor s_cursor[kPacked ? 2 : 1];
    if (kPacked && threadIdx.x == 0) {
        SeqCursor first;
        first.seq = first_boundary_at_or_after(p, l_begin);
        first.at = boundary_or_none(p, first.seq);
        s_cursor[int(l_begin / S) & 1] = first;
    }
    if (l_begin < l_end) fetch(l_begin);
    for (int64_t l0 = l_begin; l0 < l_end; l0 += S) {
        const int steps = int(min(int64_t(S), l_end - l0));
        // Tiles start at multiples of S, which divides checkpoint_len (a multiple of 32).
        if (!kLocal && l0 == checkpoint_step) {
            if (kCheckpointsViaShared && checkpoint_vectors) {
                // A channel's checkpoint is one row of N floats, consecutive channels n_checkpoints
                // rows apart: stored by each thread alone, a warp's 16-byte store touches up to 32
                // rows, 16 bytes of each (at one thread a channel, 58 of the main shape's 522 us with
                // checkpoints every 32 steps; 21 this way). The warp's states go through shared
                // memory, and consecutive lanes store consecutive 16 bytes.
                constexpr int kRow = K + 4, kQuads = K / 4;  // (padded: the 16-byte writes spread over the banks)
                const int lane = threadIdx.x % 32;
                float* warp_rows = s_dtf + (threadIdx.x / 32) * 32 * kRow;
#pragma unroll
                for (int q = 0; q < kQuads; ++q)
                    reinterpret_cast<float4*>(warp_rows + lane * kRow)[q] = make_float4(h[4 * q], h[4 * q + 1], h[4 * q + 2], h[4 * q + 3]);
                __syncwarp();
                float* warp_checkpoint = checkpoint - (lane / TPC) * checkpoint_channel_stride;  // the warp's first channel
#pragma unroll
                for (int j = 0; j < kQuads; ++j) {
                    const int from = (j * 32 + lane) / kQuads, q = (j * 32 + lane) % kQuads;  // lane `from`'s quad q
                    if ((threadIdx.x - lane + from) / TPC < rows)
                        reinterpret_cast<float4*>(warp_checkpoint + (from / TPC) * checkpoint_channel_stride + (from % TPC) * K)[q] =
                            reinterpret_cast<const float4*>(warp_rows + from * kRow)[q];
                }
            } else if (active && checkpoint_vectors) {
#pragma unroll
                for (int q = 0; q < K / 4; ++q)
                    reinterpret_cast<float4*>(checkpoint + n0)[q] = make_float4(h[4 * q], h[4 * q + 1], h[4 * q + 2], h[4 * q + 3]);
            } else if (active) {
#pragma unroll
                for (int k = 0; k < K; ++k)
                    if (n0 + k < p.dstate) checkpoint[n0 + k] = h[k];
            }
            checkpoint_step += p.checkpoint_len, checkpoint += p.dstate;
        }
        next_u.store_shared(s_u, map, time_contiguous);
        next_delta.store_shared(s_delta, map, time_contiguous);
        if (has_z) next_z.store_shared(s_z, map, time_contiguous);
        if constexpr (kVaryingBC) next_bc.store_shared(s_B, s_C, bc_time_contiguous);
        __syncthreads();
        if (l0 + S < l_end) fetch(l0 + S);

        // Per-step scalars of this tile, all independent: the channel's threads split the steps (f32
        // tiles have 16 steps: at TPC 32 half the threads take none). In batches whose loads, then
        // math, then stores are straight-line code, so that the steps' latency chains (load, two
        // special-function ops, store) overlap: with a branch per step on the options they ran one
        // after another, and this phase took 38% of the warps' time for 19% of the instructions.
        // (At one thread a channel the step loop computes them instead: kInline.)
        if constexpr (!kInline) {
            constexpr int kMine = (S + TPC - 1) / TPC, kBatch = kMine < kScalarBatch ? kMine : kScalarBatch;
            // This thread's steps are consecutive, so that 2-byte inputs load in pairs (and then a
            // warp's f32 stores, rows PF = 33 words apart, hit 32 banks).
            constexpr bool kPairs = sizeof(T) == 2 && kBatch % 2 == 0;
            auto step_of = [&](int j) { return part * kMine + j; };
            auto scalars = [&](const T* in, float* to, auto f) {
#pragma unroll
                for (int j0 = 0; j0 < kMine; j0 += kBatch) {
                    float x[kBatch];
#pragma unroll
                    for (int i = 0; i < kBatch; ++i) {
                        const int t = step_of(j0 + i);
                        if constexpr (kPairs) {
                            if (i % 2 == 0) {
                                const uint32_t w = *reinterpret_cast<const uint32_t*>(in + c * P + t);
                                const T* e = reinterpret_cast<const T*>(&w);
                                x[i] = to_f32(e[0]), x[i + 1] = to_f32(e[1]);
                            }
                        } else {
                            x[i] = S % TPC != 0 && t >= S ? 0.f : to_f32(in[c * P + t]);
                        }
                    }
#pragma unroll
                    for (int i = 0; i < kBatch; ++i) x[i] = f(x[i]);
#pragma unroll
                    for (int i = 0; i < kBatch; ++i) {
                        const int t = step_of(j0 + i);
                        if (S % TPC == 0 || t < S) to[c * PF + t] = x[i];
                    }
                }
            };
            if (p.delta_softplus) scalars(s_delta, s_dtf, [&](float x) { return softplus_fast(x + bias); });
            else scalars(s_delta, s_dtf, [&](float x) { return x + bias; });
            if (!kLocal && has_z) scalars(s_z, s_gate, [](float x) { return silu_fast(x); });
            if (!kLocal && !has_z)
                for (int j = 0; j < kMine; ++j)
                    if (S % TPC == 0 || step_of(j) < S) s_gate[c * PF + step_of(j)] = 1.f;
            // Steps past the end (in the last tile) get dt = 0, so that their decay is 1 and their
            // input 0: the step loop runs whole groups. Each thread overwrites steps it wrote above.
            if (steps < S)
                for (int j = 0; j < kMine; ++j)
                    if (step_of(j) >= steps && step_of(j) < S) s_dtf[c * PF + step_of(j)] = 0.f;
            __syncthreads();
        }

        // Software-pipelined over steps: step t + 1's shared-memory reads are issued before step t's
        // arithmetic, so their latency hides behind it. (Reading one step past the tile stays inside
        // the padded rows and the shared buffer, and the values are unused.) Steps go in groups of G
        // (which divides S), the last one whole. The reads go through pointers advanced a group at a
        // time, so that every read of a group is a base register plus a constant (addresses computed
        // from the step index cost ~6 integer instructions a step). With one thread a channel
        // (kInline), dt and the gate are computed here from delta and z, instantiated per option: a
        // step ahead of their use, so that softplus' latency chain, which the step's exponentials
        // wait on, overlaps the step before (2-4% faster than computing them in the step).
        struct StepIn {
            float u, dt, gate;  // gate: kInline only
            float4 b[K / 4], c[K / 4];
        };
        // A tile with a boundary in it (packed; `boundary` a BoundaryTile, else Off) tests each step
        // for the next one and applies the rule there, before the step's update. Only the next one's
        // tile step lives across the steps (the rule finds its place among the boundaries from the
        // tile's cursor again). The step loop names nothing but `boundary` for it: a name in its
        // (discarded) branch is still captured, which changed the unpacked kernels' code.
        auto scan_tile = [&](auto softplus_on, auto z_on, auto boundary) {
            [[maybe_unused]] constexpr bool kSoftplus = decltype(softplus_on)::value, kHasZ = decltype(z_on)::value;
            constexpr bool kBoundary = !std::is_same_v<decltype(boundary), std::false_type>;
            T* u_at = s_u + c * P;                // this channel's rows, at the group's first step
            const float* dt_at = s_dtf + c * PF;  // (its gate row: + kGateRows)
            const float* bc_at[K / 4];            // B of this thread's states (their C: + S * N)
#pragma unroll
            for (int q = 0; q < K / 4; ++q) bc_at[q] = s_B + bc_swizzle<N>(n0 + 4 * q);  // t * N: swizzle-free
            auto read_step = [&](int i) {  // step i of the current group (i <= G)
                StepIn in;
                in.u = to_f32(u_at[i]);
                if constexpr (kInline) {
                    const float delta = to_f32(u_at[i + kChannels * P]);                // s_delta
                    const float z = kHasZ ? to_f32(u_at[i + 2 * kChannels * P]) : 0.f;  // s_z
                    in.dt = kSoftplus ? softplus_fast(delta + bias) : delta + bias;
                    in.gate = kHasZ ? silu_fast(z) : 1.f;
                } else {
                    in.dt = dt_at[i];
                }
                if constexpr (kVaryingBC) {
#pragma unroll
                    for (int q = 0; q < K / 4; ++q) {
                        in.b[q] = *reinterpret_cast<const float4*>(bc_at[q] + i * N);
                        in.c[q] = *reinterpret_cast<const float4*>(bc_at[q] + i * N + S * N);
                    }
                }
                return in;
            };
            const int my_step = Sums::first_step(part);  // this thread's step of each group
            StepIn next = read_step(0);
            for (int g = 0; g < (steps + G - 1) / G; ++g) {
                float partial[G];  // this thread's share of <C, h> at each step of the group
                [[maybe_unused]] float gate[kInline ? G : 1];     // kInline: the gate of each step
                [[maybe_unused]] const int left = steps - g * G;  // steps of the group before the end
#pragma unroll
                for (int i = 0; i < G; ++i) {
                    const StepIn cur = next;
                    next = read_step(i + 1);
                    if constexpr (kBoundary) {
                        if (g * G + i == boundary.next_step) boundary.next_step = boundary.cross(g * G + i);
                    }
                    float dt = cur.dt;
                    if constexpr (kInline) {
                        if (i >= left) dt = 0.f;  // past the end: decay 1, input 0
                        if constexpr (!kLocal) gate[i] = cur.gate;
                    }
                    const float dtu = dt * cur.u;
                    if (kLocal) dt_sum += dt;
                    float Bt[K], Ct[K];
                    if constexpr (kVaryingBC) {
#pragma unroll
                        for (int q = 0; q < K / 4; ++q) {
                            Bt[4 * q] = cur.b[q].x, Bt[4 * q + 1] = cur.b[q].y, Bt[4 * q + 2] = cur.b[q].z, Bt[4 * q + 3] = cur.b[q].w;
                            Ct[4 * q] = cur.c[q].x, Ct[4 * q + 1] = cur.c[q].y, Ct[4 * q + 2] = cur.c[q].z, Ct[4 * q + 3] = cur.c[q].w;
                        }
                    } else {
#pragma unroll
                        for (int k = 0; k < K; ++k) Bt[k] = b_inv[k], Ct[k] = c_inv[k];
                    }
                    float acc[2] = {0.f, 0.f};
#pragma unroll
                    for (int k = 0; k < K; ++k) {
                        const float x = dt * a2[k];
                        const float decay = ex2_ftz(x);
                        h[k] = fmaf(decay, h[k], dtu * Bt[k]);
                        if (!kLocal) acc[k % 2] = fmaf(Ct[k], h[k], acc[k % 2]);
                    }
                    partial[i] = acc[0] + acc[1];
                }
                if constexpr (!kLocal) {
                    Sums::reduce(partial, part);
                    // Every thread of the channel has read the group's u before the shuffles; the one
                    // that holds a step's sum writes the output over its u.
                    if (Sums::finisher(part)) {
#pragma unroll
                        for (int e = 0; e < Sums::E; ++e) {
                            const int t = my_step + e;
                            const float gt = kInline ? gate[e] : dt_at[t + kGateRows];
                            u_at[t] = from_f32<T>(fmaf(skip, to_f32(u_at[t]), partial[e]) * gt);
                        }
                    }
                }
                u_at += G, dt_at += G;
#pragma unroll
                for (int q = 0; q < K / 4; ++q) bc_at[q] += G * N;
            }
        };
        using On = std::true_type;
        using Off = std::false_type;
        auto scan = [&](auto boundary) {
            if constexpr (kInline) {
                if (p.delta_softplus) has_z ? scan_tile(On{}, On{}, boundary) : scan_tile(On{}, Off{}, boundary);
                else has_z ? scan_tile(Off{}, On{}, boundary) : scan_tile(Off{}, Off{}, boundary);
            } else {
                scan_tile(Off{}, Off{}, boundary);
            }
        };
        if constexpr (kPacked) {
            // The steps test for boundaries only in a tile with one in it (block-uniform). Thread 0
            // passes the cursor on to the next tile's slot.
            const int slot = int(l0 / S) & 1;
            if (s_cursor[slot].at < l0 + steps) {
                auto cross = [&](int step) {
                    const int64_t at = apply_rule(l0 + step, s_cursor[slot].seq);
                    return at < l0 + steps ? int(at - l0) : S;
                };
                scan(BoundaryTile<decltype(cross)>{int(s_cursor[slot].at - l0), cross});
                if (threadIdx.x == 0) {
                    SeqCursor next;
                    next.seq = first_boundary_at_or_after(p, l0 + steps, s_cursor[slot].seq);
                    next.at = boundary_or_none(p, next.seq);
                    s_cursor[slot ^ 1] = next;
                }
            } else {
                if (threadIdx.x == 0) s_cursor[slot ^ 1] = s_cursor[slot];
                scan(Off{});
            }
        } else {
            scan(Off{});
        }
        __syncthreads();
        if (!kLocal) store_tile(out + x_base + l0 * p.x_stride_seq, s_u, map, time_contiguous, rows, steps);
        __syncthreads();
    }
    // Packed: thread 0's last write of the cursor (with no tile, its first) before all read it.
    if constexpr (kPacked) __syncthreads();
    if (!active) return;
    if (kLocal) {
#pragma unroll
        for (int k = 0; k < K; ++k) record[n0 + k] = h[k];
        if (part == 0) record[N] = dt_sum;
    } else if (chunk == p.n_chunks - 1) {
        if constexpr (kPacked) {
            // The rule at seqlen: the sequences that end there, and empty ones there.
            // (l_begin from blockIdx: nothing the tiles do not need lives across them.)
            const int64_t first = int64_t(blockIdx.z) * p.chunk_len;
            const int64_t tiles = (l_end - first + S - 1) / S;
            apply_rule(p.seqlen, s_cursor[int(first / S + tiles) & 1].seq);
        } else {
#pragma unroll
            for (int k = 0; k < K; ++k)
                if (n0 + k < p.dstate) p.final_state[state_base + n0 + k] = h[k];
        }
    }
}

// selective_scan_fwd_tiled[_local][_packed]_<T>_<TB>_tpc<TPC>_<varying|varying_vec|invariant> (_local
// from TPC 2 on; _packed: kPacked), launched with Tiled<TPC>::kThreads threads, Tile<T, TPC>::kSharedBytes
// of dynamic shared memory and a (tiles, batch, chunks) grid. Registers are capped for kMinBlocks
// blocks of 128 threads per SM from TPC 2 on (128 a thread); at TPC 1 for kMinBlocks blocks of 64
// (its 16 states and their operands take ~190-250).
#define SSF_TILED_BOUNDS(TPC) \
    __launch_bounds__(Tiled<TPC>::kThreads, TPC == 1 ? kMinBlocks : kMinBlocks * 128 / Tiled<TPC>::kThreads)
#define SSF_TILED_PASS(T, TB, TPC, FORM, NAME, PASS, LOCAL, PACKED)                                          \
    extern "C" __global__ void SSF_TILED_BOUNDS(TPC)                                                         \
        selective_scan_fwd_##PASS##_##T##_##TB##_tpc##TPC##_##NAME(const SelectiveScanFwdParams p) {         \
        selective_scan_fwd_tiled<T, TB, TPC, BcForm::FORM, LOCAL, PACKED>(p);                                \
    }
#define SSF_TILED_FORMS(T, TB, TPC, PASS, LOCAL, PACKED)                                                     \
    SSF_TILED_PASS(T, TB, TPC, kVarying, varying, PASS, LOCAL, PACKED)                                       \
    SSF_TILED_PASS(T, TB, TPC, kVaryingVec, varying_vec, PASS, LOCAL, PACKED)                                \
    SSF_TILED_PASS(T, TB, TPC, kInvariant, invariant, PASS, LOCAL, PACKED)
// SSF_TILED_TPCS(T, TB, PASS, LOCAL, PACKED): a pass at every TPC from 2 on. The split's first pass
// has no one-thread-a-channel form: it gained only on the longest chunks (2% at 1x4096x16384) and
// cost up to 9% of the forward on others (BENCHMARKS.md, "What did not pay"). The packed outputs'
// pass has it (selective_scan_fwd_packed.cu): a fifth more of that file's compile time, for the
// 8% the unpacked pass gains from it at batch 1 and dim 4096.
#define SSF_TILED_TPCS(T, TB, PASS, LOCAL, PACKED)                                                           \
    SSF_TILED_FORMS(T, TB, 2, PASS, LOCAL, PACKED) SSF_TILED_FORMS(T, TB, 4, PASS, LOCAL, PACKED)            \
    SSF_TILED_FORMS(T, TB, 8, PASS, LOCAL, PACKED) SSF_TILED_FORMS(T, TB, 16, PASS, LOCAL, PACKED)           \
    SSF_TILED_FORMS(T, TB, 32, PASS, LOCAL, PACKED)
