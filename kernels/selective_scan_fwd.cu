// Mamba-1 selective scan, forward (docs/selective_scan_fwd.md).
//
// Two kernels (src/ops/selective_scan/cuda.rs picks one). `lanes`: one channel (b, d) is scanned by NS consecutive lanes of a warp, each holding K = 8 of its dstate
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
__device__ __forceinline__ void selective_scan_fwd_lanes(const SelectiveScanFwdParams& p) {
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

// extern "C" entry points, named selective_scan_fwd_lanes_<T>_<TB>_ns<NS> (the Rust launcher builds the name).
#define SSF_KERNEL(T, TB, NS)                                                                  \
    extern "C" __global__ void __launch_bounds__(kBlockThreads)                                \
        selective_scan_fwd_lanes_##T##_##TB##_ns##NS(const SelectiveScanFwdParams p) {               \
        selective_scan_fwd_lanes<T, TB, NS>(p);                                                      \
    }
#define SSF_ALL_NS(T, TB) \
    SSF_KERNEL(T, TB, 1) SSF_KERNEL(T, TB, 2) SSF_KERNEL(T, TB, 4) SSF_KERNEL(T, TB, 8) SSF_KERNEL(T, TB, 16) SSF_KERNEL(T, TB, 32)

SSF_ALL_NS(f32, f32)
SSF_ALL_NS(bf16, bf16)
SSF_ALL_NS(bf16, f32)
SSF_ALL_NS(f16, f16)
SSF_ALL_NS(f16, f32)

// ---------------------------------------------------------------------------------------------
// Tiled kernel for dstate <= 16 and many channels: one thread per channel with all its states in
// registers, so the per-element work is the recurrence alone (no shuffles). A block scans 128
// channels of one batch row; u, delta and z come through shared memory in tiles of kSteps steps,
// loaded and stored with coalesced accesses in either layout, and B/C (one group per block) are
// staged as f32 and read by broadcast. A quarter of the exponentials run on the FMA pipes.
constexpr int kTileChannels = 128;
constexpr int kTiledStates = 16;
constexpr int kPolyStates = 4;

// Steps per tile, and a row pitch of an odd number of 4-byte words (17), so that the 32 threads of
// a warp reading one step of their own rows hit 32 different banks.
template <typename T> struct Tile {
    static constexpr int kSteps = 64 / sizeof(T);
    static constexpr int kPitch = kSteps + 4 / sizeof(T);
};

__device__ __forceinline__ float softplus_fast(float x) { return x > 20.f ? x : __logf(1.f + __expf(x)); }
__device__ __forceinline__ float silu_fast(float x) { return __fdividef(x, 1.f + __expf(-x)); }

// Copies the [channels x steps] tile at (row0 = first channel, l0) between global and shared memory,
// walking the global array along its contiguous axis.
template <bool kLoad, typename T>
__device__ __forceinline__ void copy_tile(T* tile, T* global, const SelectiveScanFwdParams& p, int64_t base,
                                          int64_t l0, int rows, int steps) {
    constexpr int S = Tile<T>::kSteps, P = Tile<T>::kPitch;
    const bool time_contiguous = p.x_stride_seq == 1;
    for (int i = threadIdx.x; i < kTileChannels * S; i += blockDim.x) {
        const int row = time_contiguous ? i / S : i % kTileChannels;
        const int t = time_contiguous ? i % S : i / kTileChannels;
        const bool in = row < rows && t < steps;
        const int64_t g = base + row * p.x_stride_dim + (l0 + t) * p.x_stride_seq;
        if (kLoad) {
            tile[row * P + t] = in ? global[g] : from_f32<T>(0.f);
        } else if (in) {
            global[g] = tile[row * P + t];
        }
    }
}

template <typename T, typename TB, bool kVaryingBC>
__device__ __forceinline__ void selective_scan_fwd_tiled(const SelectiveScanFwdParams& p) {
    constexpr int N = kTiledStates, S = Tile<T>::kSteps, P = Tile<T>::kPitch;
    __shared__ T s_u[kTileChannels * P];  // u in, then out
    __shared__ T s_dt[kTileChannels * P];
    __shared__ T s_z[kTileChannels * P];
    __shared__ __align__(16) float s_B[kVaryingBC ? S * N : 1];
    __shared__ __align__(16) float s_C[kVaryingBC ? S * N : 1];

    const int c = threadIdx.x;
    const int64_t b = blockIdx.y;
    const int64_t d0 = int64_t(blockIdx.x) * kTileChannels;
    const int64_t d = d0 + c;
    const int rows = int(min(int64_t(kTileChannels), p.dim - d0));
    const bool active = c < rows;
    const int64_t state_base = (b * p.dim + d) * p.dstate;
    const TB* Bm = static_cast<const TB*>(p.B);
    const TB* Cm = static_cast<const TB*>(p.C);
    // Time-varying B/C: the block's one group; time-invariant: this channel's row.
    const int64_t bc_base = kVaryingBC ? b * p.bc_stride_batch + (d0 / p.dim_per_group) * p.bc_stride_group
                                       : d * p.bc_stride_group;

    float a2[N], h[N], b_inv[kVaryingBC ? 1 : N], c_inv[kVaryingBC ? 1 : N];
#pragma unroll
    for (int n = 0; n < N; ++n) {
        const bool valid = active && n < p.dstate;
        a2[n] = valid ? p.A[d * p.dstate + n] * kLog2e : 0.f;
        h[n] = valid && p.initial_state ? p.initial_state[state_base + n] : 0.f;
        if constexpr (!kVaryingBC) {
            b_inv[n] = valid ? to_f32(Bm[bc_base + n * p.bc_stride_state]) : 0.f;
            c_inv[n] = valid ? to_f32(Cm[bc_base + n * p.bc_stride_state]) : 0.f;
        }
    }
    const float bias = active && p.delta_bias ? p.delta_bias[d] : 0.f;
    const float skip = active && p.D ? p.D[d] : 0.f;
    const bool has_z = p.z != nullptr;
    const int64_t x_base = b * p.x_stride_batch + d0 * p.x_stride_dim;
    T* u = const_cast<T*>(static_cast<const T*>(p.u));
    T* delta = const_cast<T*>(static_cast<const T*>(p.delta));
    T* z = const_cast<T*>(static_cast<const T*>(p.z));
    T* out = static_cast<T*>(p.out);

    for (int64_t l0 = 0; l0 < p.seqlen; l0 += S) {
        const int steps = int(min(int64_t(S), p.seqlen - l0));
        copy_tile<true>(s_u, u, p, x_base, l0, rows, steps);
        copy_tile<true>(s_dt, delta, p, x_base, l0, rows, steps);
        if (has_z) copy_tile<true>(s_z, z, p, x_base, l0, rows, steps);
        if constexpr (kVaryingBC) {
            const bool time_contiguous = p.bc_stride_seq == 1;
            for (int i = threadIdx.x; i < S * N; i += blockDim.x) {
                const int n = time_contiguous ? i / S : i % N;
                const int t = time_contiguous ? i % S : i / N;
                const bool in = n < p.dstate && t < steps;
                const int64_t g = bc_base + n * p.bc_stride_state + (l0 + t) * p.bc_stride_seq;
                s_B[t * N + n] = in ? to_f32(Bm[g]) : 0.f;
                s_C[t * N + n] = in ? to_f32(Cm[g]) : 0.f;
            }
        }
        __syncthreads();

        for (int t = 0; t < steps; ++t) {
            const float ul = to_f32(s_u[c * P + t]);
            float dt = to_f32(s_dt[c * P + t]) + bias;
            if (p.delta_softplus) dt = softplus_fast(dt);
            const float dtu = dt * ul;
            float Bt[N], Ct[N];
            if constexpr (kVaryingBC) {
#pragma unroll
                for (int q = 0; q < N / 4; ++q) {
                    const float4 bq = reinterpret_cast<const float4*>(s_B + t * N)[q];
                    const float4 cq = reinterpret_cast<const float4*>(s_C + t * N)[q];
                    Bt[4 * q] = bq.x, Bt[4 * q + 1] = bq.y, Bt[4 * q + 2] = bq.z, Bt[4 * q + 3] = bq.w;
                    Ct[4 * q] = cq.x, Ct[4 * q + 1] = cq.y, Ct[4 * q + 2] = cq.z, Ct[4 * q + 3] = cq.w;
                }
            } else {
#pragma unroll
                for (int n = 0; n < N; ++n) Bt[n] = b_inv[n], Ct[n] = c_inv[n];
            }
            float y = 0.f;
#pragma unroll
            for (int n = 0; n < N; ++n) {
                const float x = dt * a2[n];
                const float decay = n < kPolyStates ? exp2_fma(x) : exp2f(x);
                h[n] = fmaf(decay, h[n], dtu * Bt[n]);
                y = fmaf(Ct[n], h[n], y);
            }
            y = fmaf(skip, ul, y);
            if (has_z) y *= silu_fast(to_f32(s_z[c * P + t]));
            s_u[c * P + t] = from_f32<T>(y);
        }
        __syncthreads();
        copy_tile<false>(s_u, out, p, x_base, l0, rows, steps);
        __syncthreads();
    }
    if (active) {
#pragma unroll
        for (int n = 0; n < N; ++n)
            if (n < p.dstate) p.final_state[state_base + n] = h[n];
    }
}

// selective_scan_fwd_tiled_<T>_<TB>_<varying|invariant>
#define SSF_TILED(T, TB)                                                                          \
    extern "C" __global__ void __launch_bounds__(kTileChannels)                                   \
        selective_scan_fwd_tiled_##T##_##TB##_varying(const SelectiveScanFwdParams p) {           \
        selective_scan_fwd_tiled<T, TB, true>(p);                                                 \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(kTileChannels)                                   \
        selective_scan_fwd_tiled_##T##_##TB##_invariant(const SelectiveScanFwdParams p) {         \
        selective_scan_fwd_tiled<T, TB, false>(p);                                                \
    }

SSF_TILED(f32, f32)
SSF_TILED(bf16, bf16)
SSF_TILED(bf16, f32)
SSF_TILED(f16, f16)
SSF_TILED(f16, f32)
