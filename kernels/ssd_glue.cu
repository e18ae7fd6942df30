// The generic CUDA path of the SSD op (src/cuda/ssd.rs): SSD is run as a selective scan over
// dim = heads * headdim channels in the channel-last layout. These kernels expand the per-head
// operands to per-channel ones before the scan, and fold the scan's per-channel gradients back to
// heads after its backward; the split-heads pair does the same for the tensor-core path's heads
// wider than 64, and `gather` moves the arrays of its other stages. Every reduction sums in a fixed order (no atomics): the same inputs
// give the same bits. Their parameters: SsdGlueParams (kernels/params.h).
#include "ssd.cuh"

constexpr int kGlueThreads = 256;

template <typename T>
__device__ __forceinline__ void expand_delta(const SsdGlueParams g) {
    const SsdParams& p = g.q.fwd;
    const int64_t rows = p.batch * p.seqlen * p.heads;
    const int64_t n = rows * p.headdim;
    const T* dt = static_cast<const T*>(p.dt);
    T* delta = static_cast<T*>(g.delta);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = i / p.headdim;  // (b * seqlen + l) * heads + h
        if (g.transformed) {
            const int64_t h = row % p.heads;
            delta[i] = from_f32<T>(ssd_dt(p, to_f32(dt[row]), ssd_dt_bias(p, h)));
        } else {
            delta[i] = dt[row];
        }
    }
}

// A (and D, dt_bias where asked) from per head to per channel.
__device__ __forceinline__ void expand_params(const SsdGlueParams g) {
    const SsdParams& p = g.q.fwd;
    const int64_t dim = p.heads * p.headdim;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < dim * p.dstate;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t channel = i / p.dstate, h = channel / p.headdim;
        g.A[i] = p.A[h];
        if (i < dim) {
            const int64_t h_of_i = i / p.headdim;
            if (g.D) g.D[i] = p.D[h_of_i];
            if (g.dt_bias) g.dt_bias[i] = p.dt_bias[h_of_i];
        }
    }
}

// A warp per (b, l, h) row: ddt = sum over headdim of ddelta (lanes stride the row, then a
// butterfly: a fixed order), times the derivative of the transform when delta was transformed.
template <typename T>
__device__ __forceinline__ void reduce_ddt(const SsdGlueParams g) {
    const SsdParams& p = g.q.fwd;
    const int64_t rows = p.batch * p.seqlen * p.heads;
    const int lane = threadIdx.x & 31;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
    const T* ddelta = static_cast<const T*>(g.ddelta);
    for (int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < rows; row += warps) {
        float sum = 0.f;
        for (int64_t k = lane; k < p.headdim; k += 32) sum += to_f32(ddelta[row * p.headdim + k]);
#pragma unroll
        for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (lane != 0) continue;
        if (g.transformed) {
            const int64_t h = row % p.heads;
            const float raw = to_f32(static_cast<const T*>(p.dt)[row]);
            const float bias = ssd_dt_bias(p, h);
            bool passes;
            ssd_dt(p, raw, bias, &passes);
            const float pre = raw + bias;
            const float dsoftplus = p.dt_softplus ? 1.f / (1.f + expf(-pre)) : 1.f;
            sum = passes ? sum * dsoftplus : 0.f;
        }
        static_cast<T*>(g.q.ddt)[row] = from_f32<T>(sum);
        if (g.ddt_f32) g.ddt_f32[row] = sum;
    }
}

// The sum of x(i) for i in [0, n) over the block, in a fixed order: per thread by stride, then a tree.
template <typename F>
__device__ __forceinline__ float block_sum(int64_t n, F x, float* shared) {
    float acc = 0.f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += x(i);
    shared[threadIdx.x] = acc;
    __syncthreads();
    for (int half = kGlueThreads / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) shared[threadIdx.x] += shared[threadIdx.x + half];
        __syncthreads();
    }
    const float total = shared[0];
    __syncthreads();
    return total;
}

// One block per head: dA[h], and dD[h] and ddt_bias[h] where asked, from the per-channel gradients.
__device__ __forceinline__ void reduce_heads(const SsdGlueParams g) {
    __shared__ float shared[kGlueThreads];
    const SsdParams& p = g.q.fwd;
    const int64_t h = blockIdx.x, hd = p.headdim;
    const float* dA = g.dA + h * hd * p.dstate;
    const float da = block_sum(hd * p.dstate, [&](int64_t i) { return dA[i]; }, shared);
    if (threadIdx.x == 0) g.q.dA[h] = da;
    // Per-head D: its gradient sums its channels' (none when headdim is 0: the scratch may be null).
    if (g.q.dD && !p.D_per_channel) {
        const float dd = block_sum(hd, [&](int64_t i) { return g.dD[h * hd + i]; }, shared);
        if (threadIdx.x == 0) g.q.dD[h] = dd;
    }
    if (g.q.ddt_bias) {
        // Transformed: dt_bias entered before the transform, so its gradient is the sum of ddt;
        // else the scan had the bias per channel.
        const float db =
            g.transformed
                ? block_sum(p.batch * p.seqlen, [&](int64_t r) { return g.ddt_f32[r * p.heads + h]; }, shared)
                : block_sum(hd, [&](int64_t i) { return g.ddelta_bias[h * hd + i]; }, shared);
        if (threadIdx.x == 0) g.q.ddt_bias[h] = db;
    }
}

// chunk_states in T (a packed backward at the tensor-core shapes) widened into the scan's f32
// checkpoints, the same layout.
template <typename T>
__device__ __forceinline__ void widen_chunk_states(const SsdGlueParams g) {
    const SsdParams& p = g.q.fwd;
    const int64_t n = p.batch * p.heads * p.headdim * ssd_chunk_count(p) * p.dstate;
    const T* states = static_cast<const T*>(p.chunk_states);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        g.chunk_states_f32[i] = to_f32(states[i]);
}

// Heads wider than 64 run on the tensor-core kernels as `ways` heads of 64 each (plan::mma_shape in
// src/ops/ssd/plan.rs). Before them, dt, A, D (per head) and dt_bias are repeated for each head's split
// heads; after the backward, the split heads' gradients of those are summed back to their head, in a
// fixed order.
template <typename T>
__device__ __forceinline__ void split_heads_expand(const SsdSplitHeadsParams s) {
    const SsdParams& p = s.q.fwd;
    const int64_t split_rows = p.batch * p.seqlen * p.heads * s.ways, split_heads = p.heads * s.ways;
    const int64_t n = split_rows > split_heads ? split_rows : split_heads;
    const T* dt = static_cast<const T*>(p.dt);
    T* dt_split = static_cast<T*>(s.dt);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        if (i < split_rows) dt_split[i] = dt[i / s.ways];
        if (i < split_heads) {
            s.A[i] = p.A[i / s.ways];
            if (s.D) s.D[i] = p.D[i / s.ways];
            if (s.dt_bias) s.dt_bias[i] = p.dt_bias[i / s.ways];
        }
    }
}

template <typename T>
__device__ __forceinline__ void split_heads_fold(const SsdSplitHeadsParams s) {
    const SsdParams& p = s.q.fwd;
    const int64_t rows = p.batch * p.seqlen * p.heads, n = rows > p.heads ? rows : p.heads;
    const T* ddt_split = static_cast<const T*>(s.ddt);
    const auto fold = [&](const float* split, int64_t i) {
        float sum = 0.f;
        for (int64_t j = 0; j < s.ways; ++j) sum += split[i * s.ways + j];
        return sum;
    };
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        if (i < rows && ddt_split) {
            float sum = 0.f;
            for (int64_t j = 0; j < s.ways; ++j) sum += to_f32(ddt_split[i * s.ways + j]);
            static_cast<T*>(s.q.ddt)[i] = from_f32<T>(sum);
        }
        if (i < p.heads) {
            if (s.dA) s.q.dA[i] = fold(s.dA, i);
            if (s.dD) s.q.dD[i] = fold(s.dD, i);
            if (s.ddt_bias) s.q.ddt_bias[i] = fold(s.ddt_bias, i);
        }
    }
}

// A strided copy, or the sum of two such (SsdGather in kernels/params.h), into rows of dst_cols
// elements, zeros past dims[3]: moves a call's arrays to and from the calls of plan::PadState,
// plan::StateHalves and plan::PadHeads (src/ops/ssd/plan.rs). A row per (i0, i1, i2), the rows
// split over the grid's warps, so that the index arithmetic is per row. Where the rows are contiguous and 16-byte aligned (x, y,
// the states and their gradients: most of the bytes moved), a lane moves 16 bytes at a time, four
// loads in flight before their stores. The sum is in f32, rounded to E once.
template <typename E>
__device__ __forceinline__ uint4 add_pack(uint4 a, uint4 b) {
    constexpr int V = 16 / sizeof(E);
    E x[V], y[V];
    memcpy(x, &a, 16);
    memcpy(y, &b, 16);
#pragma unroll
    for (int k = 0; k < V; ++k) x[k] = from_f32<E>(to_f32(x[k]) + to_f32(y[k]));
    memcpy(&a, x, 16);
    return a;
}

// Packs `first`, `first + step`, ... of a row of `out` packs, 16 bytes each.
template <typename E>
__device__ __forceinline__ void gather_packed_row(const SsdGather& g, const E* from, E* to, int64_t out, bool zero,
                                                  int first, int step) {
    constexpr int V = 16 / sizeof(E), U = 4;
    const uint4* src = reinterpret_cast<const uint4*>(from);
    uint4* dst = reinterpret_cast<uint4*>(to);
    const int64_t n = g.dims[3] / V, second = g.second / V;
    for (int64_t c0 = first; c0 < out; c0 += step * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int64_t c = c0 + step * u;
            if (c < out) v[u] = zero || c >= n ? make_uint4(0, 0, 0, 0) : src[c];  // 0.0 is all zero bits in E
        }
        if (second != 0 && !zero) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int64_t c = c0 + step * u;
                if (c < n) v[u] = add_pack<E>(v[u], src[c + second]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int64_t c = c0 + step * u;
            if (c < out) dst[c] = v[u];
        }
    }
}

// Elements `first`, `first + step`, ... of a row of `out`, one at a time.
template <typename E>
__device__ __forceinline__ void gather_row(const SsdGather& g, const E* from, E* to, int64_t out, bool zero, int first,
                                           int step) {
    for (int64_t c = first; c < out; c += step) {
        const int64_t at = c * g.strides[3];
        const bool none = zero || c >= g.dims[3];
        float v = none ? 0.f : to_f32(from[at]);
        if (g.second != 0 && !none) v += to_f32(from[at + g.second]);
        to[c] = from_f32<E>(v);
    }
}

template <typename E>
__device__ __forceinline__ void gather(const SsdGather g) {
    constexpr int V = 16 / sizeof(E);
    const E* src = static_cast<const E*>(g.src);
    E* dst = static_cast<E*>(g.dst);
    const int64_t rows = g.dims[0] * g.dims[1] * g.dims[2], cols = g.dims[3];
    const int64_t out = g.dst_cols > cols ? g.dst_cols : cols;
    const bool packs = g.strides[3] == 1 && cols % V == 0 && out % V == 0 && g.strides[0] % V == 0 &&
                       g.strides[1] % V == 0 && g.strides[2] % V == 0 && g.second % V == 0 &&
                       (uintptr_t)src % 16 == 0 && (uintptr_t)dst % 16 == 0;
    // Rows of fewer than 32 packs (a state's half of 128, dt's heads) share a warp.
    const int64_t row_packs = out / V;
    const int lanes = packs && row_packs < 32 && 32 % row_packs == 0 ? int(row_packs) : 32;
    const int per_warp = 32 / lanes, lane = threadIdx.x & 31;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
    for (int64_t w = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; w * per_warp < rows; w += warps) {
        const int64_t row = w * per_warp + lane / lanes;
        if (row >= rows) continue;
        const int64_t i2 = row % g.dims[2], i01 = row / g.dims[2];
        const int64_t i1 = i01 % g.dims[1], i0 = i01 / g.dims[1];
        const E* from = src + i0 * g.strides[0] + i1 * g.strides[1] + i2 * g.strides[2];
        const bool zero = g.zero_from != 0 && i1 >= g.zero_from;
        if (packs) {
            gather_packed_row(g, from, dst + row * out, row_packs, zero, lane % lanes, lanes);
        } else {
            gather_row(g, from, dst + row * out, out, zero, lane, 32);
        }
    }
}

extern "C" __global__ void __launch_bounds__(kGlueThreads) ssd_glue_expand_params(const SsdGlueParams g) {
    expand_params(g);
}
extern "C" __global__ void __launch_bounds__(kGlueThreads) ssd_glue_reduce_heads(const SsdGlueParams g) {
    reduce_heads(g);
}

#define SSD_GLUE(T)                                                                                     \
    extern "C" __global__ void __launch_bounds__(kGlueThreads) ssd_glue_expand_delta_##T(const SsdGlueParams g) { \
        expand_delta<T>(g);                                                                             \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kGlueThreads) ssd_glue_reduce_ddt_##T(const SsdGlueParams g) { \
        reduce_ddt<T>(g);                                                                               \
    }
SSD_GLUE(f32)
SSD_GLUE(bf16)
SSD_GLUE(f16)

#define SSD_GLUE_GATHER(T)                                                                              \
    extern "C" __global__ void __launch_bounds__(kGlueThreads) ssd_glue_gather_##T(const SsdGather g) { \
        gather<T>(g);                                                                                   \
    }
SSD_GLUE_GATHER(f32)
SSD_GLUE_GATHER(bf16)
SSD_GLUE_GATHER(f16)

#define SSD_GLUE_CHUNK_STATES(T)                                                                        \
    extern "C" __global__ void __launch_bounds__(kGlueThreads) ssd_glue_widen_chunk_states_##T(const SsdGlueParams g) { \
        widen_chunk_states<T>(g);                                                                       \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kGlueThreads) ssd_glue_split_heads_expand_##T(const SsdSplitHeadsParams s) { \
        split_heads_expand<T>(s);                                                                       \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kGlueThreads) ssd_glue_split_heads_fold_##T(const SsdSplitHeadsParams s) { \
        split_heads_fold<T>(s);                                                                         \
    }
SSD_GLUE_CHUNK_STATES(bf16)
SSD_GLUE_CHUNK_STATES(f16)
