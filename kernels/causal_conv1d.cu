// Depthwise causal conv1d (width 2..4, optional bias, optional SiLU): forward, backward and the
// token-by-token update of a conv state in place; the forward and backward also over packed
// sequences (`cu_seqlens`, batch 1: the `_packed` kernels, the window restarting at each sequence).
// Both layouts through strides; threads walk the contiguous axis so that x, out, dout and dx move
// coalesced. The weight gradient is a fixed-order block reduction per channel (no atomics): the same
// inputs give the same bits.
#include "decode.cuh"

template <typename T>
__device__ __forceinline__ float ld(const void* p, int64_t i) {
    return to_f32(static_cast<const T*>(p)[i]);
}
template <typename T>
__device__ __forceinline__ void st(void* p, int64_t i, float v) {
    static_cast<T*>(p)[i] = from_f32<T>(v);
}

// (b, d, t) of flat index i over batch x dim x len, the contiguous axis of x fastest; t in [0, len).
__device__ __forceinline__ void coords(const ConvParams& p, int64_t i, int64_t len, int64_t& b, int64_t& d,
                                       int64_t& t) {
    if (p.x_stride_seq == 1) {
        t = i % len;
        i /= len;
        d = i % p.dim;
        b = i / p.dim;
    } else {
        d = i % p.dim;
        i /= p.dim;
        t = i % len;
        b = i / len;
    }
}

__device__ __forceinline__ int64_t xi(const ConvParams& p, int64_t b, int64_t d, int64_t t) {
    return b * p.x_stride_batch + d * p.x_stride_dim + t * p.x_stride_seq;
}

// Packed sequences (batch 1): the sequence a step belongs to, steps [start, end), its initial state
// row `row`.
struct Seq {
    int64_t start, end, row;
};

// Packed sequences: the last s with cu_seqlens[s] <= t (so an empty sequence yields to the next one
// on its boundary). The device does not check the boundaries: the search stays in 0..num_seqs - 1 and
// the clamps keep every read inside the buffers whatever the values (results then undefined).
__device__ __forceinline__ Seq packed_seq(const ConvParams& p, int64_t s) {
    const int64_t start = min(max((int64_t)p.cu_seqlens[s], (int64_t)0), p.seqlen);
    const int64_t end = min(max((int64_t)p.cu_seqlens[s + 1], start), p.seqlen);
    return {start, end, s};
}

__device__ __forceinline__ Seq seq_at(const ConvParams& p, int64_t t) {
    int64_t lo = 0, hi = p.num_seqs - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (p.cu_seqlens[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    Seq q = packed_seq(p, lo);
    q.start = min(q.start, t);
    q.end = max(q.end, t + 1);
    return q;
}

// x at step s of row (b, d), s in [-(width - 1), seqlen): before 0, the initial state or 0.
// (The unpacked kernels keep their own copies of xpad, pre_act and grad_pre: going through a Seq of
// the whole row gave them other code, 3% slower in the conv backward.)
template <typename T>
__device__ __forceinline__ float xpad(const ConvParams& p, int64_t b, int64_t d, int64_t s) {
    if (s >= 0) return ld<T>(p.x, xi(p, b, d, s));
    if (!p.initial_states) return 0.f;
    return ld<T>(p.initial_states, (b * p.dim + d) * (p.width - 1) + p.width - 1 + s);
}

// Packed: x at step s of sequence q, s in [q.start - (width - 1), seqlen): before q.start, its
// initial state or 0.
template <typename T>
__device__ __forceinline__ float xpad(const ConvParams& p, const Seq& q, int64_t b, int64_t d, int64_t s) {
    if (s >= q.start) return ld<T>(p.x, xi(p, b, d, s));
    if (!p.initial_states) return 0.f;
    return ld<T>(p.initial_states, (q.row * p.dim + d) * (p.width - 1) + p.width - 1 + s - q.start);
}

template <typename WT>
__device__ __forceinline__ float load_weights(const ConvParams& p, int64_t d, float (&w)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = k < p.width ? ld<WT>(p.weight, d * p.width + k) : 0.f;
    return p.bias ? ld<WT>(p.bias, d) : 0.f;
}

template <typename T>
__device__ __forceinline__ float pre_act(const ConvParams& p, const float (&w)[4], float bias, int64_t b, int64_t d,
                                         int64_t t) {
    float acc = bias;
    for (int k = 0; k < p.width; ++k) acc = fmaf(w[k], xpad<T>(p, b, d, t - (p.width - 1) + k), acc);
    return acc;
}

// Packed: t in [q.start, seqlen).
template <typename T>
__device__ __forceinline__ float pre_act(const ConvParams& p, const float (&w)[4], float bias, const Seq& q, int64_t b,
                                         int64_t d, int64_t t) {
    float acc = bias;
    for (int k = 0; k < p.width; ++k) acc = fmaf(w[k], xpad<T>(p, q, b, d, t - (p.width - 1) + k), acc);
    return acc;
}

__device__ __forceinline__ float silu_grad(float x) {
    const float s = 1.f / (1.f + expf(-x));
    return s * (1.f + x * (1.f - s));
}

// dout times the activation's derivative at step t.
template <typename T>
__device__ __forceinline__ float grad_pre(const ConvParams& p, const float (&w)[4], float bias, int64_t b, int64_t d,
                                          int64_t t) {
    const float g = ld<T>(p.dout, xi(p, b, d, t));
    return p.silu ? g * silu_grad(pre_act<T>(p, w, bias, b, d, t)) : g;
}

template <typename T>
__device__ __forceinline__ float grad_pre(const ConvParams& p, const float (&w)[4], float bias, const Seq& q, int64_t b,
                                          int64_t d, int64_t t) {
    const float g = ld<T>(p.dout, xi(p, b, d, t));
    return p.silu ? g * silu_grad(pre_act<T>(p, w, bias, q, b, d, t)) : g;
}

template <typename T, typename WT, bool kPacked>
__device__ __forceinline__ void fwd(const ConvParams p) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.batch * p.dim * p.seqlen) return;
    int64_t b, d, t;
    coords(p, i, p.seqlen, b, d, t);
    float w[4];
    const float bias = load_weights<WT>(p, d, w);
    float v;
    if constexpr (kPacked)
        v = pre_act<T>(p, w, bias, seq_at(p, t), b, d, t);
    else
        v = pre_act<T>(p, w, bias, b, d, t);
    st<T>(p.out, xi(p, b, d, t), p.silu ? silu(v) : v);
}

// The gradient of padded step s of sequence q: sum_k w[k] g[s + W - 1 - k] over the steps of q.
template <typename T>
__device__ __forceinline__ float dx_at(const ConvParams& p, const float (&w)[4], float bias, const Seq& q, int64_t b,
                                       int64_t d, int64_t s) {
    float acc = 0.f;
    for (int k = 0; k < p.width; ++k) {
        const int64_t t = s + p.width - 1 - k;
        if (t >= q.start && t < q.end) acc = fmaf(w[k], grad_pre<T>(p, w, bias, q, b, d, t), acc);
    }
    return acc;
}

// dx (s >= 0) and dinitial_states (s < 0) at padded step s.
template <typename T, typename WT>
__device__ __forceinline__ void bwd_dx(const ConvParams p) {
    const int64_t len = p.seqlen + p.width - 1;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.batch * p.dim * len) return;
    int64_t b, d, s;
    coords(p, i, len, b, d, s);
    s -= p.width - 1;
    if (s < 0 && !p.dinitial_states) return;
    float w[4];
    const float bias = load_weights<WT>(p, d, w);
    float acc = 0.f;
    for (int k = 0; k < p.width; ++k) {
        const int64_t t = s + p.width - 1 - k;
        if (t >= 0 && t < p.seqlen) acc = fmaf(w[k], grad_pre<T>(p, w, bias, b, d, t), acc);
    }
    if (s >= 0)
        st<T>(p.out, xi(p, b, d, s), acc);
    else
        st<T>(p.dinitial_states, (b * p.dim + d) * (p.width - 1) + p.width - 1 + s, acc);
}

// Packed (batch 1): dx over dim x seqlen, then, with dinitial_states, its (num_seqs, dim, width - 1).
template <typename T, typename WT>
__device__ __forceinline__ void bwd_dx_packed(const ConvParams p) {
    const int64_t n_dx = p.dim * p.seqlen;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t k = p.width - 1;
    if (i >= n_dx + (p.dinitial_states ? p.num_seqs * p.dim * k : 0)) return;
    int64_t b, d, s;
    Seq q;
    if (i < n_dx) {
        coords(p, i, p.seqlen, b, d, s);
        q = seq_at(p, s);
    } else {
        int64_t j = i - n_dx;
        const int64_t r = j % k;
        j /= k;
        d = j % p.dim;
        b = 0;
        q = packed_seq(p, j / p.dim);
        s = q.start - k + r;
    }
    float w[4];
    const float bias = load_weights<WT>(p, d, w);
    const float acc = dx_at<T>(p, w, bias, q, b, d, s);
    if (i < n_dx)
        st<T>(p.out, xi(p, b, d, s), acc);
    else
        st<T>(p.dinitial_states, i - n_dx, acc);
}

constexpr int kReduceThreads = 256;

// dweight and dbias of channel blockIdx.x: each thread sums a fixed strided subset of (b, t), then a
// fixed tree over the block.
template <typename T, typename WT, bool kPacked>
__device__ __forceinline__ void bwd_dw(const ConvParams p) {
    __shared__ float part[5][kReduceThreads];
    const int64_t d = blockIdx.x;
    float w[4];
    const float bias = load_weights<WT>(p, d, w);
    float acc[5] = {0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t j = threadIdx.x; j < p.batch * p.seqlen; j += kReduceThreads) {
        const int64_t b = j / p.seqlen, t = j - b * p.seqlen;
        if constexpr (kPacked) {
            const Seq q = seq_at(p, t);
            const float g = grad_pre<T>(p, w, bias, q, b, d, t);
            for (int k = 0; k < p.width; ++k) acc[k] = fmaf(g, xpad<T>(p, q, b, d, t - (p.width - 1) + k), acc[k]);
            acc[4] += g;
        } else {
            const float g = grad_pre<T>(p, w, bias, b, d, t);
            for (int k = 0; k < p.width; ++k) acc[k] = fmaf(g, xpad<T>(p, b, d, t - (p.width - 1) + k), acc[k]);
            acc[4] += g;
        }
    }
#pragma unroll
    for (int k = 0; k < 5; ++k) part[k][threadIdx.x] = acc[k];
    __syncthreads();
    for (int half = kReduceThreads / 2; half > 0; half /= 2) {
        if (threadIdx.x < half)
#pragma unroll
            for (int k = 0; k < 5; ++k) part[k][threadIdx.x] += part[k][threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x < p.width) st<WT>(p.dweight, d * p.width + threadIdx.x, part[threadIdx.x][0]);
    if (threadIdx.x == 4 && p.dbias) st<WT>(p.dbias, d, part[4][0]);
}

// One thread per (b, d) row: the row's tokens in order from its conv state, which it then rewrites.
template <typename T, typename WT>
__device__ __forceinline__ void update(const ConvParams p) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.batch * p.dim) return;
    const int64_t b = i / p.dim, d = i - b * p.dim;
    const int64_t slot = p.state_batch_indices ? (int64_t)p.state_batch_indices[b] : b;
    if (slot < 0 || slot >= p.n_slots) {
        for (int64_t t = 0; t < p.seqlen; ++t) st<T>(p.out, xi(p, b, d, t), 0.f);
        return;
    }
    float w[4];
    const float bias = load_weights<WT>(p, d, w);
    const int wd = (int)p.width;
    T* cs = static_cast<T*>(p.conv_state) + (slot * p.dim + d) * (wd - 1);
    float win[4];
    for (int k = 0; k < wd - 1; ++k) win[k] = to_f32(cs[k]);
    for (int64_t t = 0; t < p.seqlen; ++t) {
        win[wd - 1] = ld<T>(p.x, xi(p, b, d, t));
        float acc = bias;
        for (int k = 0; k < wd; ++k) acc = fmaf(w[k], win[k], acc);
        st<T>(p.out, xi(p, b, d, t), p.silu ? silu(acc) : acc);
        for (int k = 0; k < wd - 1; ++k) win[k] = win[k + 1];
    }
    for (int k = 0; k < wd - 1; ++k) cs[k] = from_f32<T>(win[k]);
}

#define CONV(T, WT)                                                                                        \
    extern "C" __global__ void causal_conv1d_fwd_##T##_##WT(const ConvParams p) { fwd<T, WT, false>(p); }  \
    extern "C" __global__ void causal_conv1d_fwd_packed_##T##_##WT(const ConvParams p) {                  \
        fwd<T, WT, true>(p);                                                                               \
    }                                                                                                      \
    extern "C" __global__ void causal_conv1d_bwd_dx_##T##_##WT(const ConvParams p) { bwd_dx<T, WT>(p); }   \
    extern "C" __global__ void causal_conv1d_bwd_dx_packed_##T##_##WT(const ConvParams p) {               \
        bwd_dx_packed<T, WT>(p);                                                                           \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(kReduceThreads)                                           \
        causal_conv1d_bwd_dw_##T##_##WT(const ConvParams p) {                                             \
        bwd_dw<T, WT, false>(p);                                                                           \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(kReduceThreads)                                           \
        causal_conv1d_bwd_dw_packed_##T##_##WT(const ConvParams p) {                                      \
        bwd_dw<T, WT, true>(p);                                                                            \
    }                                                                                                      \
    extern "C" __global__ void causal_conv1d_update_##T##_##WT(const ConvParams p) { update<T, WT>(p); }
// The weight is f32 or the dtype of x.
CONV(f32, f32)
CONV(bf16, bf16)
CONV(bf16, f32)
CONV(f16, f16)
CONV(f16, f32)
