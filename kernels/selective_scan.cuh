// The selective scan's kernel parameters, shared by the forward and backward kernels.
#pragma once
#include "common.cuh"

// Mirror of `FwdParams` in src/ops/selective_scan/mod.rs: keep field for field.
struct SelectiveScanFwdParams {
    const void* u;
    const void* delta;
    const float* A;
    const void* B;
    const void* C;
    const float* D;
    const void* z;
    const float* delta_bias;
    const float* initial_state;
    void* out;
    float* final_state;
    int64_t batch, dim, seqlen, dstate, dim_per_group;
    int64_t x_stride_batch, x_stride_dim, x_stride_seq;
    int64_t bc_stride_batch, bc_stride_group, bc_stride_state, bc_stride_seq;
    int32_t delta_softplus;
    int32_t reserved;
    // Sequence split (tiled kernel): chunks of chunk_len steps, per-chunk (state, sum of dt) in
    // workspace [n_chunks - 1][batch][dim][kChunkRecord] f32. n_chunks == 1: no split.
    float* workspace;
    int64_t chunk_len, n_chunks;
    // Residuals for the backward pass: [batch][dim][ceil(seqlen / checkpoint_len)][dstate] f32, the
    // state entering every checkpoint_len-th step (a multiple of 32). checkpoint_len == 0: none.
    float* checkpoints;
    int64_t checkpoint_len;
};
static_assert(sizeof(SelectiveScanFwdParams) == 11 * 8 + 12 * 8 + 8 + 3 * 8 + 2 * 8, "mirror of FwdParams");

// Mirror of `BwdParams`: the forward's operands (out / final_state unused; checkpoints read; workspace =
// the backward's partial sums), the cotangents, and the gradients (optional ones null).
struct SelectiveScanBwdParams {
    SelectiveScanFwdParams fwd;
    const void* dout;
    const float* dfinal_state;
    void* du;
    void* ddelta;
    float* dA;
    void* dB;
    void* dC;
    float* dD;
    void* dz;
    float* ddelta_bias;
    float* dinitial_state;
};
static_assert(sizeof(SelectiveScanBwdParams) == sizeof(SelectiveScanFwdParams) + 11 * 8, "mirror of BwdParams");

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
