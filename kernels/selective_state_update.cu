// Decode: one token of Mamba-1's selective scan with the state updated in place
// (selective_state_update), and the fused step of one layer's SSM part (mamba_decode_step):
// causal conv1d update + SiLU + state update + D skip + z gate, one launch.
//
// `lanes` threads per (batch, channel) row; each thread streams 16-byte vectors of the row's state
// (read once, written once, evict-first) and the row's output is summed by warp shuffles. Rows of a
// block are consecutive channels, so x, dt, z and out are read and written coalesced. Rows whose
// state_batch_indices entry is negative or >= n_slots are skipped: output 0, states untouched.
#include "decode.cuh"

template <typename T>
__device__ __forceinline__ float load_dt(const StateUpdateParams& p, int64_t row, int64_t d) {
    float dt = to_f32(static_cast<const T*>(p.dt)[row]);
    if (p.dt_bias) dt += p.dt_bias[d];
    return p.dt_softplus ? softplus(dt) : dt;
}

// Finishes row (b, d): D skip and gate; written by the row's first lane.
template <typename T>
__device__ __forceinline__ void finish_row(const StateUpdateParams& p, int64_t row, int64_t d, float y, float x,
                                           bool skip) {
    if (skip) {
        y = 0.f;
    } else {
        if (p.D) y = fmaf(p.D[d], x, y);
        if (p.z) y *= silu(to_f32(static_cast<const T*>(p.z)[row]));
    }
    static_cast<T*>(p.out)[row] = from_f32<T>(y);
}

__device__ __forceinline__ int64_t slot_of(const int32_t* indices, int64_t b) {
    return indices ? (int64_t)__ldg(indices + b) : b;
}

template <typename T, typename W, typename S>
__device__ __forceinline__ void state_update(const StateUpdateParams p) {
    const int lanes = p.lanes;
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / lanes) + threadIdx.x / lanes;
    const int lane = threadIdx.x & (lanes - 1);
    const bool active = row < p.batch * p.dim;
    float y = 0.f, x = 0.f;
    bool skip = true;
    int64_t d = 0;
    if (active) {
        const int64_t b = row / p.dim;
        d = row - b * p.dim;
        const int64_t slot = slot_of(p.state_batch_indices, b);
        skip = slot < 0 || slot >= p.n_slots;
        if (!skip) {
            x = to_f32(static_cast<const T*>(p.x)[row]);
            y = update_states<W, S>(p, b, d, slot, x, load_dt<T>(p, row, d), lane);
        }
    }
    y = row_sum(y, lanes);
    if (active && lane == 0) finish_row<T>(p, row, d, y, x, skip);
}

template <typename T, typename W, typename S, typename WT>
__device__ __forceinline__ void decode_step(const DecodeParams q) {
    const StateUpdateParams& p = q.ssm;
    const int lanes = p.lanes;
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / lanes) + threadIdx.x / lanes;
    const int lane = threadIdx.x & (lanes - 1);
    const bool active = row < p.batch * p.dim;
    float y = 0.f, x = 0.f;
    bool skip = true;
    int64_t b = 0, d = 0, slot = 0;
    if (active) {
        b = row / p.dim;
        d = row - b * p.dim;
        slot = slot_of(p.state_batch_indices, b);
        skip = slot < 0 || slot >= p.n_slots;
    }
    // The row's first lane runs the conv (and shifts the conv state); the others get its output.
    if (active && !skip && lane == 0) {
        const int w = (int)q.width;
        T* cs = static_cast<T*>(q.conv_state) + (slot * p.dim + d) * (w - 1);
        const WT* wt = static_cast<const WT*>(q.conv_weight) + d * w;
        float win[4];
        for (int k = 0; k < w - 1; ++k) win[k] = to_f32(cs[k]);
        win[w - 1] = to_f32(static_cast<const T*>(p.x)[row]);
        float acc = q.conv_bias ? to_f32(static_cast<const WT*>(q.conv_bias)[d]) : 0.f;
        for (int k = 0; k < w; ++k) acc = fmaf(to_f32(wt[k]), win[k], acc);
        for (int k = 0; k < w - 1; ++k) cs[k] = from_f32<T>(win[k + 1]);
        x = silu(acc);
    }
    x = __shfl_sync(0xffffffffu, x, (threadIdx.x & 31) & ~(lanes - 1));
    if (active && !skip) y = update_states<W, S>(p, b, d, slot, x, load_dt<T>(p, row, d), lane);
    y = row_sum(y, lanes);
    if (active && lane == 0) finish_row<T>(p, row, d, y, x, skip);
}

#define SSU(T, W, S)                                                                                   \
    extern "C" __global__ void __launch_bounds__(1024) selective_state_update_##T##_##W##_##S(         \
        const StateUpdateParams p) {                                                                   \
        state_update<T, W, S>(p);                                                                      \
    }
#define DECODE(T, W, S, WT)                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) mamba_decode_step_##T##_##W##_##S##_##WT(       \
        const DecodeParams q) {                                                                        \
        decode_step<T, W, S, WT>(q);                                                                   \
    }
// Every (x, B/C, state[, conv weight]) combination the validation admits: each of the last three is
// f32 or the dtype of x.
#define FOR_HALF(M, T) M(T, T, T) M(T, T, f32) M(T, f32, T) M(T, f32, f32)
SSU(f32, f32, f32)
FOR_HALF(SSU, bf16)
FOR_HALF(SSU, f16)
#define DECODE_W(T, W, S) DECODE(T, W, S, T) DECODE(T, W, S, f32)
DECODE(f32, f32, f32, f32)
FOR_HALF(DECODE_W, bf16)
FOR_HALF(DECODE_W, f16)
