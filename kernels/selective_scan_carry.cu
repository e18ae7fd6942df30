// The state carried into a seqlen shard (selective_scan_carry_fwd / _bwd; the definition is in
// src/ops/selective_scan/carry.rs, the use in docs/sharding.md): how a state entering the shard
// reaches its outputs (fwd: added to the outputs its scan made from a zero state, in place), and
// how the outputs' gradient reaches that state (bwd, the transpose, per segment); and the chunk
// records of the forward's split where its own first pass does not apply.
//
// One warp per segment of a (batch, channel) row, kCarrySteps consecutive steps per lane: the
// lanes' dt go through a warp prefix sum onto the cumulative dt, which starts from the row's dt
// sums over the segments before. With softplus (dt >= 0) a segment stops once every remaining
// term has fallen below f32's smallest normal, and one that starts there does nothing: a channel
// costs what its decay needs, and a slowly decaying one runs its segments in parallel (one warp a
// row took 3.4 ms at 1 x 4096 x 65536, latency-bound on the slowest rows' 400 serial passes).
#include <float.h>

#include "selective_scan.cuh"

constexpr int kCarryWarps = 4;
// States a pass accumulates in registers (the bwd; the fwd's unrolled state loop).
constexpr int kCarryStates = 16;
// Steps per lane per pass (consecutive): their loads are in flight together, as one vector where
// the row is contiguous.
constexpr int kCarrySteps = 4;

__device__ __forceinline__ float warp_inclusive_sum(float v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float t = __shfl_up_sync(~0u, v, o);
        if (lane >= o) v += t;
    }
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
    return v;
}

// Whether every a[n] (log2-scaled A) at cumulative dt `cs`, times |scale[n]| (1 without), is
// below f32's smallest normal, over `states` states: nothing is left to add.
__device__ __forceinline__ bool carried_out(const float* a, const float* scale, int states, float cs, int lane) {
    bool out = true;
    for (int n = lane; n < states; n += 32) out &= ex2_ftz(a[n] * cs) * (scale ? fabsf(scale[n]) : 1.f) < FLT_MIN;
    return __all_sync(~0u, out);
}

// The states rounded up to whole groups of kCarryStates: the padding (A = 0, state 0) adds nothing,
// and spares the unrolled state loops a bound check (with one, each state's loads waited for the
// one before).
__device__ __forceinline__ int carry_padded_states(const SelectiveScanFwdParams& p) {
    return (static_cast<int>(p.dstate) + kCarryStates - 1) / kCarryStates * kCarryStates;
}

// Whether rows along time of `ptr` (stride 1) can be read kCarrySteps at a time: whole groups of
// steps in every segment, aligned vectors.
template <typename T>
__device__ __forceinline__ bool carry_vec(const SelectiveScanCarryParams& q, const void* ptr, int64_t stride) {
    return ptr == nullptr || (stride == 1 && q.scan.seqlen % kCarrySteps == 0 && q.segment_len % kCarrySteps == 0 &&
                              reinterpret_cast<uintptr_t>(ptr) % (kCarrySteps * sizeof(T)) == 0);
}

// The kCarrySteps steps from g of a row (element stride `stride`), as f32; past the sequence the
// row's last (discarded). `vec`: one vector load (carry_vec).
template <typename T>
__device__ __forceinline__ void load_steps(const T* row, int64_t g, int64_t seqlen, int64_t stride, bool vec,
                                           float (&v)[kCarrySteps]) {
    if (vec) {
        const T* at = row + min(g, seqlen - kCarrySteps);
        if constexpr (sizeof(T) == 4) {
            const float4 w = *reinterpret_cast<const float4*>(at);
            v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
        } else {
            const uint2 w = *reinterpret_cast<const uint2*>(at);
            const T* e = reinterpret_cast<const T*>(&w);
#pragma unroll
            for (int k = 0; k < kCarrySteps; ++k) v[k] = to_f32(e[k]);
        }
    } else {
#pragma unroll
        for (int k = 0; k < kCarrySteps; ++k) v[k] = to_f32(row[min(g + k, seqlen - 1) * stride]);
    }
}

// One warp's segment of one row.
struct CarrySegment {
    int64_t row, segment, d, x0, c0;  // c0: C of the row's group at step 0, state 0
    int64_t first, end;               // its steps
    int lane;
    float cs;                // the cumulative dt before `first`
    float* a;                // the row's A * log2(e), then (fwd) its state, padded: shared memory
    bool vec_x, vec_c;
};

// Sets up this warp's segment; false for a warp past the last.
template <typename T, typename TC>
__device__ __forceinline__ bool carry_segment(const SelectiveScanCarryParams& q, CarrySegment& s) {
    const SelectiveScanFwdParams& p = q.scan;
    const int warp = threadIdx.x >> 5;
    s.lane = threadIdx.x & 31;
    const int64_t item = static_cast<int64_t>(blockIdx.x) * kCarryWarps + warp;
    if (item >= p.batch * p.dim * q.n_segments) return false;
    s.row = item / q.n_segments;
    s.segment = item % q.n_segments;
    const int64_t b = s.row / p.dim;
    s.d = s.row % p.dim;
    s.x0 = b * p.x_stride_batch + s.d * p.x_stride_dim;
    s.c0 = b * p.bc_stride_batch + (s.d / p.dim_per_group) * p.bc_stride_group;
    s.first = min(s.segment * q.segment_len, p.seqlen);
    s.end = min(s.first + q.segment_len, p.seqlen);
    float before = 0.f;
    for (int64_t k = s.lane; k < s.segment; k += 32) before += q.dt_sums[s.row * q.n_segments + k];
    s.cs = warp_sum(before);
    extern __shared__ float carry_smem[];
    const int padded = carry_padded_states(p);
    s.a = carry_smem + warp * 2 * padded;
    for (int n = s.lane; n < padded; n += 32) s.a[n] = n < p.dstate ? p.A[s.d * p.dstate + n] * kLog2e : 0.f;
    s.vec_x = carry_vec<T>(q, p.delta, p.x_stride_seq) && carry_vec<T>(q, p.u, p.x_stride_seq) &&
              carry_vec<T>(q, p.z, p.x_stride_seq);
    s.vec_c = carry_vec<TC>(q, p.C, p.bc_stride_seq) && p.bc_stride_state % kCarrySteps == 0;
    return true;
}

// A lane's steps of a pass (from g): their cumulative dt, on the segment's `cs`, which moves to
// the pass's end; steps past the segment add nothing.
template <typename T>
__device__ __forceinline__ void carry_pass(const SelectiveScanFwdParams& p, CarrySegment& s, int64_t g,
                                           float (&cs)[kCarrySteps]) {
    load_steps(static_cast<const T*>(p.delta) + s.x0, g, p.seqlen, p.x_stride_seq, s.vec_x, cs);
    const float bias = p.delta_bias ? p.delta_bias[s.d] : 0.f;
#pragma unroll
    for (int k = 0; k < kCarrySteps; ++k) {
        const float dt = p.delta_softplus ? softplus_fast(cs[k] + bias) : cs[k] + bias;
        cs[k] = (g + k < s.end ? dt : 0.f) + (k > 0 ? cs[k - 1] : 0.f);
    }
    const float lane_sum = cs[kCarrySteps - 1];
    const float before = s.cs + warp_inclusive_sum(lane_sum, s.lane) - lane_sum;
#pragma unroll
    for (int k = 0; k < kCarrySteps; ++k) cs[k] += before;
    s.cs = __shfl_sync(~0u, cs[kCarrySteps - 1], 31);
}

template <typename T, typename TC>
__device__ void carry_fwd(const SelectiveScanCarryParams& q) {
    const SelectiveScanFwdParams& p = q.scan;
    CarrySegment s;
    if (!carry_segment<T, TC>(q, s)) return;
    const int padded = carry_padded_states(p);
    float* h = s.a + padded;
    for (int n = s.lane; n < padded; n += 32) h[n] = n < p.dstate ? p.initial_state[s.row * p.dstate + n] : 0.f;
    __syncwarp();
    const TC* C = static_cast<const TC*>(p.C) + s.c0;
    T* out = static_cast<T*>(p.out) + s.x0;
    const T* z = p.z ? static_cast<const T*>(p.z) + s.x0 : nullptr;
    const int dstate = static_cast<int>(p.dstate);
    if (p.delta_softplus && carried_out(s.a, h, dstate, s.cs, s.lane)) return;
    for (int64_t l0 = s.first; l0 < s.end; l0 += 32 * kCarrySteps) {
        const int64_t g = l0 + s.lane * kCarrySteps;
        float cs[kCarrySteps], x[kCarrySteps], gate[kCarrySteps], add[kCarrySteps] = {};
        carry_pass<T>(p, s, g, cs);
        load_steps(out, g, p.seqlen, p.x_stride_seq, s.vec_x, x);
        if (z) {
            load_steps(z, g, p.seqlen, p.x_stride_seq, s.vec_x, gate);
#pragma unroll
            for (int k = 0; k < kCarrySteps; ++k) gate[k] = silu_fast(gate[k]);
        }
        for (int n0 = 0; n0 < padded; n0 += kCarryStates) {
#pragma unroll
            for (int j = 0; j < kCarryStates; ++j) {
                const int n = n0 + j;
                float c[kCarrySteps];
                load_steps(C + min(n, dstate - 1) * p.bc_stride_state, g, p.seqlen, p.bc_stride_seq, s.vec_c, c);
                const float a = s.a[n], hn = h[n];
#pragma unroll
                for (int k = 0; k < kCarrySteps; ++k) add[k] = fmaf(c[k] * ex2_ftz(a * cs[k]), hn, add[k]);
            }
        }
#pragma unroll
        for (int k = 0; k < kCarrySteps; ++k) {
            if (g + k < s.end) out[(g + k) * p.x_stride_seq] = from_f32<T>(fmaf(add[k], z ? gate[k] : 1.f, x[k]));
        }
        if (p.delta_softplus && carried_out(s.a, h, dstate, s.cs, s.lane)) break;
    }
}

template <typename T, typename TC>
__device__ void carry_bwd(const SelectiveScanCarryParams& q) {
    const SelectiveScanFwdParams& p = q.scan;
    CarrySegment s;
    if (!carry_segment<T, TC>(q, s)) return;
    __syncwarp();
    const TC* C = static_cast<const TC*>(p.C) + s.c0;
    const T* dout = static_cast<const T*>(p.u) + s.x0;
    const T* z = p.z ? static_cast<const T*>(p.z) + s.x0 : nullptr;
    const int dstate = static_cast<int>(p.dstate);
    float* parts = q.dstate_parts + (s.row * q.n_segments + s.segment) * p.dstate;
    const float start = s.cs;
    for (int n0 = 0; n0 < dstate; n0 += kCarryStates) {
        const int states = min(kCarryStates, dstate - n0);
        const float* a = s.a + n0;
        float acc[kCarryStates] = {};
        s.cs = start;
        const bool done = p.delta_softplus && carried_out(a, nullptr, states, s.cs, s.lane);
        for (int64_t l0 = s.first; l0 < (done ? s.first : s.end); l0 += 32 * kCarrySteps) {
            const int64_t g = l0 + s.lane * kCarrySteps;
            float cs[kCarrySteps], gy[kCarrySteps];
            carry_pass<T>(p, s, g, cs);
            load_steps(dout, g, p.seqlen, p.x_stride_seq, s.vec_x, gy);
            if (z) {
                float zv[kCarrySteps];
                load_steps(z, g, p.seqlen, p.x_stride_seq, s.vec_x, zv);
#pragma unroll
                for (int k = 0; k < kCarrySteps; ++k) gy[k] *= silu_fast(zv[k]);
            }
#pragma unroll
            for (int k = 0; k < kCarrySteps; ++k) gy[k] = g + k < s.end ? gy[k] : 0.f;
#pragma unroll
            for (int j = 0; j < kCarryStates; ++j) {
                float c[kCarrySteps];
                load_steps(C + min(n0 + j, dstate - 1) * p.bc_stride_state, g, p.seqlen, p.bc_stride_seq, s.vec_c, c);
#pragma unroll
                for (int k = 0; k < kCarrySteps; ++k) acc[j] = fmaf(gy[k] * c[k], ex2_ftz(a[j] * cs[k]), acc[j]);
            }
            if (p.delta_softplus && carried_out(a, nullptr, states, s.cs, s.lane)) break;
        }
#pragma unroll
        for (int j = 0; j < kCarryStates; ++j) {
            const float v = warp_sum(acc[j]);
            if (s.lane == 0 && j < states) parts[n0 + j] = v;
        }
    }
}

// selective_scan_chunk_records where the tiled forward's first pass does not apply (rows not whole
// 16-byte vectors, groups that split a tile of channels): one thread per float of a record, (chunk,
// batch, channel, i), walking its chunk's steps. The tiled pass's layout: i < dstate a state, the
// padding 0, the last float the sum of dt. Slow, but taken only where the fast pass cannot run.
constexpr int kRecordsThreads = 128;

template <typename T, typename TB> __device__ __forceinline__ void chunk_records_any(const SelectiveScanFwdParams& p) {
    const int64_t tpc = max(int64_t(2), int64_t(1) << (64 - __clzll((max(p.dstate, int64_t(1)) + 7) / 8 - 1)));
    const int64_t floats = 8 * tpc + 1;  // split_record_floats
    const int64_t rows = p.batch * p.dim;
    const int64_t i = int64_t(blockIdx.x) * kRecordsThreads + threadIdx.x;
    if (i >= p.n_chunks * rows * floats) return;
    const int64_t n = i % floats, row = i / floats % rows, chunk = i / floats / rows;
    const int64_t b = row / p.dim, d = row % p.dim;
    const bool dt_sum = n == floats - 1;
    float h = 0.f;
    if (dt_sum || n < p.dstate) {
        const float a2 = dt_sum ? 0.f : p.A[d * p.dstate + n] * kLog2e;
        const float bias = p.delta_bias ? p.delta_bias[d] : 0.f;
        const T* u = static_cast<const T*>(p.u);
        const T* delta = static_cast<const T*>(p.delta);
        const TB* B = static_cast<const TB*>(p.B);
        const int64_t x0 = b * p.x_stride_batch + d * p.x_stride_dim;
        const int64_t b0 = b * p.bc_stride_batch + (d / p.dim_per_group) * p.bc_stride_group + (dt_sum ? 0 : n) * p.bc_stride_state;
        const int64_t l_end = min(p.seqlen, (chunk + 1) * p.chunk_len);
        for (int64_t l = chunk * p.chunk_len; l < l_end; ++l) {
            float dt = to_f32(delta[x0 + l * p.x_stride_seq]) + bias;
            if (p.delta_softplus) dt = softplus(dt);
            h = dt_sum ? h + dt
                       : fmaf(ex2_ftz(dt * a2), h, dt * to_f32(B[b0 + l * p.bc_stride_seq]) * to_f32(u[x0 + l * p.x_stride_seq]));
        }
    }
    p.workspace[i] = h;
}

#define CARRY_KERNELS(T, TB)                                                                                 \
    extern "C" __global__ void __launch_bounds__(kCarryWarps * 32)                                          \
        selective_scan_carry_fwd_##T##_##TB(const SelectiveScanCarryParams q) {                             \
        carry_fwd<T, TB>(q);                                                                                 \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(kCarryWarps * 32)                                          \
        selective_scan_carry_bwd_##T##_##TB(const SelectiveScanCarryParams q) {                             \
        carry_bwd<T, TB>(q);                                                                                 \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(kRecordsThreads)                                           \
        selective_scan_chunk_records_##T##_##TB(const SelectiveScanFwdParams p) {                           \
        chunk_records_any<T, TB>(p);                                                                         \
    }
SCAN_TYPE_PAIRS(CARRY_KERNELS)
