// Mamba-2's chunked SSD scan: what the forward (ssd_fwd.cu) and backward (ssd_bwd.cu) kernels share.
// Their parameters (SsdParams, SsdBwdParams) are in kernels/params.h, generated from src/ops/ssd/mod.rs.
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
#include "params.h"

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
