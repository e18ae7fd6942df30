// What the selective scan's forward and backward kernels share: their parameters
// (SelectiveScanFwdParams, SelectiveScanBwdParams: kernels/params.h, generated from
// src/ops/selective_scan/mod.rs) and helpers.
#pragma once
#include "common.cuh"
#include "params.h"

// Where B/C element i = t * N + n sits in a kernel's f32 staging rows of N states. From N = 64 on,
// the 16-byte pieces of states 32..63 of every 64 trade places in pairs (i ^ 4 where bit 5 is set),
// so that the 8 threads of a channel reading their 8 consecutive states of one step hit different
// banks (unswizzled, threads 4 apart share banks: at dstate 64 the forward ran 1.37x and the
// backward 1.13x slower). Keeps 16-byte pieces whole; the identity below 64.
template <int N> __device__ __forceinline__ int bc_swizzle(int i) { return N >= 64 ? i ^ ((i >> 3) & 4) : i; }

__device__ __forceinline__ int64_t checkpoint_count(const SelectiveScanFwdParams& p) {
    return p.checkpoint_len > 0 ? (p.seqlen + p.checkpoint_len - 1) / p.checkpoint_len : 0;
}

// Per-step sums over a channel's TPC threads (consecutive lanes, `part` = lane % TPC), G steps at a
// time, so that each thread finishes some steps instead of every thread summing every step: a
// reduce-scatter over the first R = min(TPC, G) threads (each round a thread keeps one half of its
// values, by one bit of `part`, and adds its partner's copy of that half), then butterflies over the
// channel's other threads. Leaves v[0 .. E) = the channel's sums of steps first_step(part) + e.
template <int TPC, int G> struct StepSums {
    static_assert(G > 0 && (G & (G - 1)) == 0 && TPC > 0 && (TPC & (TPC - 1)) == 0, "powers of two");
    static constexpr int R = TPC < G ? TPC : G;  // threads that share out the steps
    static constexpr int E = G / R;              // steps each of them finishes

    // Threads with part >= R hold copies of another's sums.
    static __device__ __forceinline__ bool finisher(int part) { return part < R; }

    static __device__ __forceinline__ int first_step(int part) {
        int first = 0;
#pragma unroll
        for (int o = 1, half = G / 2; o < R; o *= 2, half /= 2)
            if (part & o) first += half;
        return first;
    }

    static __device__ __forceinline__ void reduce(float (&v)[G], int part) {
#pragma unroll
        for (int o = 1, half = G / 2; o < R; o *= 2, half /= 2) {
            const bool upper = part & o;
#pragma unroll
            for (int i = 0; i < half; ++i) {
                const float keep = upper ? v[half + i] : v[i];
                const float send = upper ? v[i] : v[half + i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
        }
#pragma unroll
        for (int o = R; o < TPC; o *= 2)
#pragma unroll
            for (int e = 0; e < E; ++e) v[e] += __shfl_xor_sync(0xffffffffu, v[e], o);
    }
};
