// Mamba-1 selective scan, forward (docs/selective_scan_fwd.md).
//
// One channel (b, d) is scanned by NS consecutive lanes of a warp, each holding K = 8 of its dstate
// states in registers; per step the lanes' partial <C, h> are summed with warp shuffles. Layouts and
// the two forms of B/C are all expressed through the strides in the parameter struct.
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
};
static_assert(sizeof(SelectiveScanFwdParams) == 11 * 8 + 12 * 8 + 8, "mirror of FwdParams");

constexpr int kStatesPerLane = 8;
constexpr int kBlockThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T, typename TB, int NS>
__device__ __forceinline__ void selective_scan_fwd(const SelectiveScanFwdParams& p) {
    constexpr int K = kStatesPerLane;
    const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t channels = p.batch * p.dim;
    const int slice = int(thread % NS);
    // Lanes past the last channel mirror it (they must still join the shuffles) but store nothing.
    const bool active = thread / NS < channels;
    const int64_t channel = active ? thread / NS : channels - 1;
    const int64_t b = channel / p.dim, d = channel % p.dim;

    float a2[K], h[K];  // A * log2(e), so exp(dt * A) = exp2(dt * a2)
    bool valid[K];
    const int64_t state0 = int64_t(slice) * K;
    const int64_t state_base = channel * p.dstate;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int64_t n = state0 + k;
        valid[k] = n < p.dstate;
        a2[k] = valid[k] ? p.A[d * p.dstate + n] * kLog2e : 0.f;
        h[k] = valid[k] && p.initial_state ? p.initial_state[state_base + n] : 0.f;
    }

    const T* u = static_cast<const T*>(p.u);
    const T* delta = static_cast<const T*>(p.delta);
    const T* z = static_cast<const T*>(p.z);
    T* out = static_cast<T*>(p.out);
    const TB* Bm = static_cast<const TB*>(p.B);
    const TB* Cm = static_cast<const TB*>(p.C);
    const int64_t x_base = b * p.x_stride_batch + d * p.x_stride_dim;
    const int64_t bc_base = b * p.bc_stride_batch + (d / p.dim_per_group) * p.bc_stride_group +
                            state0 * p.bc_stride_state;
    const float bias = p.delta_bias ? p.delta_bias[d] : 0.f;
    const float skip = p.D ? p.D[d] : 0.f;

    for (int64_t l = 0; l < p.seqlen; ++l) {
        const int64_t xi = x_base + l * p.x_stride_seq;
        const float ul = to_f32(u[xi]);
        float dt = to_f32(delta[xi]) + bias;
        if (p.delta_softplus) dt = softplus(dt);
        const float dtu = dt * ul;
        const int64_t bci = bc_base + l * p.bc_stride_seq;
        float y = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (valid[k]) {
                const float bk = to_f32(Bm[bci + k * p.bc_stride_state]);
                const float ck = to_f32(Cm[bci + k * p.bc_stride_state]);
                h[k] = exp2f(dt * a2[k]) * h[k] + bk * dtu;
                y += ck * h[k];
            }
        }
#pragma unroll
        for (int offset = NS / 2; offset > 0; offset /= 2) y += __shfl_xor_sync(0xffffffffu, y, offset);
        if (active && slice == 0) {
            y += skip * ul;
            if (z) y *= silu(to_f32(z[xi]));
            out[xi] = from_f32<T>(y);
        }
    }
    if (active) {
#pragma unroll
        for (int k = 0; k < K; ++k)
            if (valid[k]) p.final_state[state_base + state0 + k] = h[k];
    }
}

// extern "C" entry points, named selective_scan_fwd_<T>_<TB>_ns<NS> (the Rust launcher builds the name).
#define SSF_KERNEL(T, TB, NS)                                                                  \
    extern "C" __global__ void __launch_bounds__(kBlockThreads)                                \
        selective_scan_fwd_##T##_##TB##_ns##NS(const SelectiveScanFwdParams p) {               \
        selective_scan_fwd<T, TB, NS>(p);                                                      \
    }
#define SSF_ALL_NS(T, TB) \
    SSF_KERNEL(T, TB, 1) SSF_KERNEL(T, TB, 2) SSF_KERNEL(T, TB, 4) SSF_KERNEL(T, TB, 8) SSF_KERNEL(T, TB, 16) SSF_KERNEL(T, TB, 32)

SSF_ALL_NS(f32, f32)
SSF_ALL_NS(bf16, bf16)
SSF_ALL_NS(bf16, f32)
SSF_ALL_NS(f16, f16)
SSF_ALL_NS(f16, f32)
