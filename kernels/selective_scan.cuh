// What the selective scan's forward and backward kernels share: their parameters
// (SelectiveScanFwdParams, SelectiveScanBwdParams: kernels/params.h, generated from
// src/ops/selective_scan/mod.rs) and helpers.
#pragma once
#include "common.cuh"
#include "params.h"

// The (u, B/C) dtype pairs every scan kernel is instantiated for: M(T, TB) for each (B/C f32 or u's
// dtype; SCAN_TYPES in src/cuda/kernels.rs).
#define SCAN_TYPE_PAIRS(M) M(f32, f32) M(bf16, bf16) M(bf16, f32) M(f16, f16) M(f16, f32)

// Where B/C element i = t * N + n sits in a kernel's f32 staging rows of N states. From N = 64 on,
// the 16-byte pieces of states 32..63 of every 64 trade places in pairs (i ^ 4 where bit 5 is set),
// so that the 8 threads of a channel reading their 8 consecutive states of one step hit different
// banks (unswizzled, threads 4 apart share banks: at dstate 64 the forward ran 1.37x and the
// backward 1.13x slower). Keeps 16-byte pieces whole; the identity below 64.
template <int N> __device__ __forceinline__ int bc_swizzle(int i) { return N >= 64 ? i ^ ((i >> 3) & 4) : i; }

__device__ __forceinline__ int64_t checkpoint_count(const SelectiveScanFwdParams& p) {
    return p.checkpoint_len > 0 ? (p.seqlen + p.checkpoint_len - 1) / p.checkpoint_len : 0;
}

// Packed sequences (cu_seqlens non-null, batch 1): boundary s in [0, num_seqs], clamped to
// [0, seqlen], so that values the host could not check still give positions inside the sequence.
__device__ __forceinline__ int64_t seq_boundary(const SelectiveScanFwdParams& p, int64_t s) {
    return min(max(int64_t(__ldg(p.cu_seqlens + s)), int64_t(0)), p.seqlen);
}

// The first s >= from with seq_boundary(s) >= l (num_seqs + 1: none): steps doubling from `from`,
// then bisection, so O(log) of the distance (a block's next boundary is usually near the last one).
// Stays inside [from, num_seqs + 1] whatever the values (from <= num_seqs + 1).
__device__ __forceinline__ int64_t first_boundary_at_or_after(const SelectiveScanFwdParams& p, int64_t l,
                                                              int64_t from = 0) {
    int64_t lo = from, hi = from;  // boundaries [from, lo) are below l
    for (int64_t step = 1;; step *= 2) {
        if (hi > p.num_seqs) {
            hi = p.num_seqs + 1;
            break;
        }
        if (seq_boundary(p, hi) >= l) break;
        lo = hi + 1;
        hi = lo + step;
    }
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (seq_boundary(p, mid) < l) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// Position of boundary s, or INT64_MAX past the last.
__device__ __forceinline__ int64_t boundary_or_none(const SelectiveScanFwdParams& p, int64_t s) {
    return s <= p.num_seqs ? seq_boundary(p, s) : INT64_MAX;
}

// The forward's rule at position l (before step l's update; l = seqlen: after the last step), for
// every boundary from s on at or before l (only at l when cu_seqlens is valid), in ascending order:
// end(s - 1) (final_state[s - 1] = h) for s >= 1, then start(s) (h = initial_state[s] or 0) for
// s < num_seqs. Advances s past them and returns the position of the next boundary (INT64_MAX:
// none). `<= l` rather than `== l`: decreasing values are applied late, never skipped.
template <typename End, typename Start>
__device__ __forceinline__ int64_t cross_boundaries(const SelectiveScanFwdParams& p, int64_t& s, int64_t l, End end,
                                                    Start start) {
    for (; s <= p.num_seqs; ++s) {
        const int64_t at = seq_boundary(p, s);
        if (at > l) return at;
        if (s >= 1) end(s - 1);
        if (s < p.num_seqs) start(s);
    }
    return INT64_MAX;
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
