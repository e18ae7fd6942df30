// Shared by the decode-time kernels (selective_state_update.cu, causal_conv1d.cu): their parameters
// (StateUpdateParams, ConvParams, DecodeParams: kernels/params.h, generated from
// src/ops/{state_update,conv1d,mamba_decode}/mod.rs) and vector access helpers.
#pragma once
#include "common.cuh"
#include "params.h"

// The state is read once and written once: evict-first loads and stores (.cs). (The default cache
// policy, and the accurate softplus instead of softplus_fast, were slower: BENCHMARKS.md, "What did
// not pay".)
template <typename V>
__device__ __forceinline__ V load_state(const V* p) { return __ldcs(p); }

template <typename V>
__device__ __forceinline__ void store_state(V* p, V v) { __stcs(p, v); }

template <int Bytes> struct Raw;
template <> struct Raw<16> { typedef int4 type; };
template <> struct Raw<8> { typedef int2 type; };
template <> struct Raw<4> { typedef int type; };
template <> struct Raw<2> { typedef short type; };

// N consecutive elements from p as floats: in vectors of up to 16 bytes when `vec` (aligned, all
// valid), else element by element, those past `valid` read as 0. `Stream`: the data is the state
// (read once: load_state).
template <int N, bool Stream, typename T>
__device__ __forceinline__ void load_n(const T* p, int64_t valid, bool vec, float (&out)[N]) {
    if (vec) {
        constexpr int kBytes = N * (int)sizeof(T);
        constexpr int kChunk = kBytes >= 16 ? 16 : kBytes;
        typedef typename Raw<kChunk>::type V;
        V raw[kBytes / kChunk];
#pragma unroll
        for (int i = 0; i < kBytes / kChunk; ++i) raw[i] = Stream ? load_state(reinterpret_cast<const V*>(p) + i) : __ldg(reinterpret_cast<const V*>(p) + i);
        const T* e = reinterpret_cast<const T*>(raw);
#pragma unroll
        for (int k = 0; k < N; ++k) out[k] = to_f32(e[k]);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) out[k] = k < valid ? to_f32(p[k]) : 0.f;
    }
}

template <int N, typename T>
__device__ __forceinline__ void store_n(T* p, int64_t valid, bool vec, const float (&v)[N]) {
    if (vec) {
        constexpr int kBytes = N * (int)sizeof(T);
        constexpr int kChunk = kBytes >= 16 ? 16 : kBytes;
        typedef typename Raw<kChunk>::type V;
        V raw[kBytes / kChunk];
        T* e = reinterpret_cast<T*>(raw);
#pragma unroll
        for (int k = 0; k < N; ++k) e[k] = from_f32<T>(v[k]);
#pragma unroll
        for (int i = 0; i < kBytes / kChunk; ++i) store_state(reinterpret_cast<V*>(p) + i, raw[i]);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k)
            if (k < valid) p[k] = from_f32<T>(v[k]);
    }
}

// Sum over the `lanes` threads of a row (adjacent lanes of one warp). Every thread in `mask` must
// call it: by default the whole warp; row_mask(lanes) names the calling row's lanes only.
__device__ __forceinline__ float row_sum(float v, int lanes, unsigned mask = 0xffffffffu) {
    for (int off = lanes / 2; off > 0; off /= 2) v += __shfl_xor_sync(mask, v, off);
    return v;
}
__device__ __forceinline__ unsigned row_mask(int lanes) {
    return lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1) << ((threadIdx.x & 31) & ~(lanes - 1));
}

// One row's share of the state update: this lane's states of row (b, d) in `slot`, with input x and
// (softplus'd, biased) dt. Returns this lane's part of <C, state>.
template <typename W, typename S>
__device__ __forceinline__ float update_states(const StateUpdateParams& p, int64_t b, int64_t d, int64_t slot,
                                               float x, float dt, int lane) {
    constexpr int kN = 16 / sizeof(S);  // states per lane per pass: one 16-byte vector of the state
    const bool vec = p.vectorized != 0;
    const int64_t bc = (b * p.groups + d / p.dim_per_group) * p.dstate;
    const float* A = p.A + d * p.dstate;
    const W* B = static_cast<const W*>(p.B) + bc;
    const W* C = static_cast<const W*>(p.C) + bc;
    S* h = static_cast<S*>(p.state) + (slot * p.dim + d) * p.dstate;
    const float dtx = dt * x;
    const float dt2 = dt * kLog2e;
    float y = 0.f;
    for (int64_t n = (int64_t)lane * kN; n < p.dstate; n += (int64_t)p.lanes * kN) {
        const int64_t valid = p.dstate - n;
        float hs[kN], a[kN], bv[kN], cv[kN];
        load_n<kN, true>(h + n, valid, vec, hs);
        load_n<kN, false>(A + n, valid, vec, a);
        load_n<kN, false>(B + n, valid, vec, bv);
        load_n<kN, false>(C + n, valid, vec, cv);
#pragma unroll
        for (int k = 0; k < kN; ++k) {
            // The output reads the state as stored, so that a half-precision state gives what the
            // next step will see.
            hs[k] = to_f32(from_f32<S>(fmaf(ex2_ftz(dt2 * a[k]), hs[k], dtx * bv[k])));
            y = fmaf(cv[k], hs[k], y);
        }
        store_n<kN>(h + n, valid, vec, hs);
    }
    return y;
}
