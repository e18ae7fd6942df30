// Mamba-2's chunked SSD scan: the kernel parameters shared by the forward (ssd_fwd.cu) and backward
// (ssd_bwd.cu) kernels, mirrored field for field by `SsdParams` / `SsdBwdParams` in src/ops/ssd/mod.rs.
//
// Math (docs/ssd.md), per batch b, head h (group g = h / (heads / groups)), step t:
//   dt_t  = dt[b,t,h] (+ dt_bias[h]); softplus if dt_softplus; then clamped to [dt_min, dt_max]
//   S_t   = exp(dt_t * A[h]) * S_{t-1} + dt_t * x[b,t,h,:] (outer) B[b,t,g,:]      (headdim x dstate, f32)
//   y_t   = S_t C[b,t,g,:] + D x[b,t,h,:]        (D[h], or D[h,p] when D_per_channel)
//   y_t  *= silu(z[b,t,h,:])                      when z is given
// S_{-1} = initial_states[b,h] (zero when null). The result does not depend on chunk_size except
// through rounding; chunk_size (32, 64, 128 or 256) fixes the layout of chunk_states (the state entering each chunk).
#pragma once
#include "common.cuh"

// All arrays dense row-major. T = the element type of x, dt, B, C, z, y (and of dx, ddt, dB, dC, dz).
struct SsdParams {
    const void* x;                // (batch, seqlen, heads, headdim) T
    const void* dt;               // (batch, seqlen, heads) T
    const float* A;               // (heads)
    const void* B;                // (batch, seqlen, groups, dstate) T
    const void* C;                // (batch, seqlen, groups, dstate) T
    const float* D;               // (heads) or (heads, headdim), or null
    const void* z;                // (batch, seqlen, heads, headdim) T, or null
    const float* dt_bias;         // (heads), or null
    const float* initial_states;  // (batch, heads, headdim, dstate), or null
    void* y;                      // (batch, seqlen, heads, headdim) T
    float* final_states;          // (batch, heads, headdim, dstate), or null
    // (batch, heads, headdim, n_chunks, dstate), n_chunks = ceil(seqlen / chunk_size): the state
    // entering each chunk (chunk 0: the initial state); the selective scan's checkpoint layout, with
    // dim = heads x headdim. T in the tensor-core kernels, f32 in the generic path (the selective
    // scan's checkpoints). Written by the forward when non-null; read by the backward.
    void* chunk_states;
    // Scratch from the host (size: the launcher's workspace function); contents undefined afterwards.
    void* workspace;
    int64_t workspace_bytes;
    int64_t batch, seqlen, heads, headdim, dstate, groups, chunk_size;
    // dt is clamped to [dt_min, dt_max] (always: ssd_dt). -inf and +inf never clamp; 0 and +inf (the
    // default) only zero negative dt, so after softplus they do nothing.
    float dt_min, dt_max;
    int32_t dt_softplus;
    int32_t D_per_channel;  // D is (heads, headdim)
};
static_assert(sizeof(SsdParams) == 14 * 8 + 7 * 8 + 4 * 4, "mirror of SsdParams");

// The backward: the forward's operands (y and final_states unused, chunk_states read, workspace =
// the backward's scratch), the cotangents, and the gradients (null where the input is absent).
// dx, ddt, dB, dC, dz are T; dA, dD (shaped like D), ddt_bias, dinitial_states are f32.
struct SsdBwdParams {
    SsdParams fwd;
    const void* dy;
    const float* dfinal_states;  // or null
    void* dx;
    void* ddt;
    float* dA;
    void* dB;
    void* dC;
    float* dD;
    void* dz;
    float* ddt_bias;
    float* dinitial_states;
};
static_assert(sizeof(SsdBwdParams) == sizeof(SsdParams) + 11 * 8, "mirror of SsdBwdParams");

__device__ __forceinline__ int64_t ssd_chunk_count(const SsdParams& p) {
    return (p.seqlen + p.chunk_size - 1) / p.chunk_size;
}

// Head h's dt bias (0 without one). Kernels that walk a head's steps load it once: looked up per step,
// next to its use, it was a memory latency on every tile's path.
__device__ __forceinline__ float ssd_dt_bias(const SsdParams& p, int64_t h) { return p.dt_bias ? p.dt_bias[h] : 0.f; }

// dt after bias (ssd_dt_bias), softplus and clamp; `passes` = whether the clamp let it through (its
// gradient).
__device__ __forceinline__ float ssd_dt(const SsdParams& p, float raw, float bias, bool* passes = nullptr) {
    float v = raw + bias;
    if (p.dt_softplus) v = softplus(v);
    const bool inside = v >= p.dt_min && v <= p.dt_max;
    if (passes) *passes = inside;
    return fminf(fmaxf(v, p.dt_min), p.dt_max);
}
