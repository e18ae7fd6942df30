// The tensor-core SSD backward's element-wise and reduction kernels: gate_grad (the gradient through
// z's gate, before the main kernel), reduce_bc (dB and dC from the per-head partials) and
// reduce_params (dA, ddt_bias and dD from the per-(part, batch, head) partials), each sum in a fixed
// order.
#pragma once
#include "ssd_mma.cuh"

namespace ssd_mma {

// With z: y = y_pre silu(z). Before the ungated backward runs with dy silu(z) as its dy: dz =
// dy y_pre silu'(z), y_pre recomputed by the forward kernel into `gated`, dy silu(z) over it (each
// element read before it is written). Two elements per thread, grid-stride.
template <typename T> __device__ __forceinline__ void gate_grad(const SsdBwdMmaParams& a) {
    using T2 = typename Ops<T>::T2;
    const SsdParams& p = a.q.fwd;
    const int64_t pairs = p.batch * p.seqlen * p.heads * kP / 2;
    const T2* z = static_cast<const T2*>(p.z);
    const T2* dy = static_cast<const T2*>(a.q.dy);
    const T2* y_pre = static_cast<const T2*>(a.gated);
    T2* dz = static_cast<T2*>(a.q.dz);
    T2* dy_gated = static_cast<T2*>(a.gated);
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pairs; i += int64_t(gridDim.x) * blockDim.x) {
        const float2 zv = Ops<T>::unpack2(z[i]), g = Ops<T>::unpack2(dy[i]), y = Ops<T>::unpack2(y_pre[i]);
        const float s0 = 1.f / (1.f + expf(-zv.x)), s1 = 1.f / (1.f + expf(-zv.y));
        dz[i] = Ops<T>::pack2(g.x * y.x * s0 * (1.f + zv.x * (1.f - s0)), g.y * y.y * s1 * (1.f + zv.y * (1.f - s1)));
        dy_gated[i] = Ops<T>::pack2(g.x * zv.x * s0, g.y * zv.y * s1);
    }
}

// The per-head path: dB, dC summed over a group's heads from the partials, in a fixed order
// (grid-stride over (batch, seqlen, groups) x 8-state vectors: 16-byte loads).
template <typename T> __device__ __forceinline__ void reduce_bc(const SsdBwdMmaParams& a) {
    using T2 = typename Ops<T>::T2;
    const SsdParams& p = a.q.fwd;
    constexpr int V = 8;  // states per thread (dstate is 64 or 128)
    const int64_t vecs = p.dstate / V, total = p.batch * p.seqlen * p.groups * vecs, per_group = p.heads / p.groups;
    T* dB = static_cast<T*>(a.q.dB);
    T* dC = static_cast<T*>(a.q.dC);
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t v = i % vecs, g = (i / vecs) % p.groups, bl = i / (vecs * p.groups);
        const int64_t base = (bl * p.heads + g * per_group) * p.dstate + v * V;
        float sb[V] = {}, sc[V] = {};
#pragma unroll 4
        for (int64_t k = 0; k < per_group; ++k) {
            const uint4 rb = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.db_part) + base + k * p.dstate);
            const uint4 rc = *reinterpret_cast<const uint4*>(static_cast<const T*>(a.dc_part) + base + k * p.dstate);
            const T2* eb = reinterpret_cast<const T2*>(&rb);
            const T2* ec = reinterpret_cast<const T2*>(&rc);
#pragma unroll
            for (int e = 0; e < V / 2; ++e) {
                const float2 fb = Ops<T>::unpack2(eb[e]), fc = Ops<T>::unpack2(ec[e]);
                sb[2 * e] += fb.x, sb[2 * e + 1] += fb.y;
                sc[2 * e] += fc.x, sc[2 * e + 1] += fc.y;
            }
        }
        const int64_t out = i * V;  // (bl, g, v) row-major = the element offset / V
#pragma unroll
        for (int e = 0; e < V; ++e) {
            dB[out + e] = from_f32<T>(sb[e]);
            dC[out + e] = from_f32<T>(sc[e]);
        }
    }
}

// The sum of v over a block of kP threads, in a fixed order (`partial`: two floats of shared memory).
__device__ __forceinline__ float block_sum_kp(float v, float* partial) {
    static_assert(kP == 64, "two warps");
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    return partial[0] + partial[1];
}
// A block of kP threads per head: thread `col` sums column col of dD over the (part, batch) rows, and
// every kP-th row of dA and ddt_bias; block_sum_kp adds the threads' sums.
__device__ __forceinline__ void reduce_params(const SsdBwdMmaParams& a) {
    __shared__ float partial[3][2];
    pdl_wait_prerequisite();  // launched programmatically after bc_sums or reduce_bc
    const SsdParams& p = a.q.fwd;
    const int64_t h = blockIdx.x, col = threadIdx.x, rows = a.n_parts * p.batch;  // (part, batch) pairs
    float dd = 0.f, da = 0.f, dbias = 0.f;
    if (a.q.dD) {
#pragma unroll 8
        for (int64_t r = 0; r < rows; ++r) dd += a.dd_part[(r * p.heads + h) * kP + col];
        if (p.D_per_channel) a.q.dD[h * kP + col] = dd;
    }
    for (int64_t r = col; r < rows; r += kP) {
        da += a.da_part[r * p.heads + h];
        dbias += a.dbias_part[r * p.heads + h];
    }
    const float dd_all = block_sum_kp(dd, partial[0]), da_all = block_sum_kp(da, partial[1]);
    const float dbias_all = block_sum_kp(dbias, partial[2]);
    if (col != 0) return;
    if (a.q.dD && !p.D_per_channel) a.q.dD[h] = dd_all;
    a.q.dA[h] = da_all;
    if (a.q.ddt_bias) a.q.ddt_bias[h] = dbias_all;
}

}  // namespace ssd_mma
