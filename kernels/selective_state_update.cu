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

// The fast path, for a vectorized state of exactly one 16-byte vector per lane (dstate == lanes * kN):
// each thread group takes R rows (a block's rows for each r contiguous) and issues every load of
// its rows before any arithmetic. Instantiated with R = 1: R = 4 was slower on the H100
// (BENCHMARKS.md), and the host takes this path on small problems only.
// `kFused`: the row's first lane also runs the conv (decode_step's conv half).
// Largest block of the fast kernels (more registers per thread than the general ones).
constexpr int kFastBlock = 256;

template <typename T, typename W, typename S, typename WT, bool kFused, int R>
__device__ __forceinline__ void rows_fast(const DecodeParams q) {
    const StateUpdateParams& p = q.ssm;
    constexpr int kN = 16 / sizeof(S);
    const int lanes = p.lanes;
    const int per_block = blockDim.x / lanes;
    const int lane = threadIdx.x & (lanes - 1);
    const int64_t first = (int64_t)blockIdx.x * per_block * R + threadIdx.x / lanes;
    const int64_t total = p.batch * p.dim;
    float h[R][kN], a[R][kN], bv[R][kN], cv[R][kN], x[R], dt[R], zv[R], win[R][3], cw[R][4], cb[R];
    int64_t slot[R];
    bool ok[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int64_t row = first + (int64_t)r * per_block;
        const int64_t b = row / p.dim, d = row - b * p.dim;
        slot[r] = row < total ? slot_of(p.state_batch_indices, b) : -1;
        ok[r] = slot[r] >= 0 && slot[r] < p.n_slots;
        if (!ok[r]) continue;
        const int64_t n = (int64_t)lane * kN;
        const int64_t bc = (b * p.groups + d / p.dim_per_group) * p.dstate + n;
        load_n<kN, true>(static_cast<const S*>(p.state) + (slot[r] * p.dim + d) * p.dstate + n, kN, true, h[r]);
        load_n<kN, false>(p.A + d * p.dstate + n, kN, true, a[r]);
        load_n<kN, false>(static_cast<const W*>(p.B) + bc, kN, true, bv[r]);
        load_n<kN, false>(static_cast<const W*>(p.C) + bc, kN, true, cv[r]);
        x[r] = to_f32(static_cast<const T*>(p.x)[row]);
        dt[r] = to_f32(static_cast<const T*>(p.dt)[row]) + (p.dt_bias ? p.dt_bias[d] : 0.f);
        zv[r] = p.z ? to_f32(static_cast<const T*>(p.z)[row]) : 0.f;
        if (kFused && lane == 0) {
            const int w = (int)q.width;
            const T* cs = static_cast<const T*>(q.conv_state) + (slot[r] * p.dim + d) * (w - 1);
            const WT* wt = static_cast<const WT*>(q.conv_weight) + d * w;
            // Taps on the conv state (k < w - 1) and the tap on the new input, kept apart so that
            // every register index is static.
#pragma unroll
            for (int k = 0; k < 3; ++k) {
                win[r][k] = k < w - 1 ? to_f32(cs[k]) : 0.f;
                cw[r][k] = k < w - 1 ? to_f32(wt[k]) : 0.f;
            }
            cw[r][3] = to_f32(wt[w - 1]);
            cb[r] = q.conv_bias ? to_f32(static_cast<const WT*>(q.conv_bias)[d]) : 0.f;
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int64_t row = first + (int64_t)r * per_block;
        const int64_t b = row / p.dim, d = row - b * p.dim;
        if (kFused) {
            float xc = 0.f;
            if (ok[r] && lane == 0) {
                const int w = (int)q.width;
                float acc = fmaf(cw[r][3], x[r], cb[r]);
#pragma unroll
                for (int k = 0; k < 3; ++k) acc = fmaf(cw[r][k], win[r][k], acc);
                T* cs = static_cast<T*>(q.conv_state) + (slot[r] * p.dim + d) * (w - 1);
#pragma unroll
                for (int k = 0; k < 3; ++k)
                    if (k < w - 1) cs[k] = from_f32<T>(k + 1 < w - 1 ? win[r][k + 1] : x[r]);
                xc = silu(acc);
            }
            x[r] = __shfl_sync(0xffffffffu, xc, (threadIdx.x & 31) & ~(lanes - 1));
        }
        float y = 0.f;
        if (ok[r]) {
            const float dtv = p.dt_softplus ? softplus(dt[r]) : dt[r];
            const float dt2 = dtv * kLog2e, dtx = dtv * x[r];
#pragma unroll
            for (int k = 0; k < kN; ++k) {
                h[r][k] = to_f32(from_f32<S>(fmaf(ex2_ftz(dt2 * a[r][k]), h[r][k], dtx * bv[r][k])));
                y = fmaf(cv[r][k], h[r][k], y);
            }
            const int64_t n = (int64_t)lane * kN;
            store_n<kN>(static_cast<S*>(p.state) + (slot[r] * p.dim + d) * p.dstate + n, kN, true, h[r]);
        }
        y = row_sum(y, lanes);
        if (row < total && lane == 0) {
            if (!ok[r]) {
                y = 0.f;
            } else {
                if (p.D) y = fmaf(p.D[d], x[r], y);
                if (p.z) y *= silu(zv[r]);
            }
            static_cast<T*>(p.out)[row] = from_f32<T>(y);
        }
    }
}

#define SSU(T, W, S)                                                                                   \
    extern "C" __global__ void __launch_bounds__(1024) selective_state_update_##T##_##W##_##S(         \
        const StateUpdateParams p) {                                                                   \
        state_update<T, W, S>(p);                                                                      \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kFastBlock) selective_state_update_##T##_##W##_##S##_r1(    \
        const StateUpdateParams p) {                                                                   \
        rows_fast<T, W, S, T, false, 1>(DecodeParams{p, nullptr, nullptr, nullptr, 0});               \
    }
#define DECODE(T, W, S, WT)                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) mamba_decode_step_##T##_##W##_##S##_##WT(       \
        const DecodeParams q) {                                                                        \
        decode_step<T, W, S, WT>(q);                                                                   \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kFastBlock) mamba_decode_step_##T##_##W##_##S##_##WT##_r1(  \
        const DecodeParams q) {                                                                        \
        rows_fast<T, W, S, WT, true, 1>(q);                                                            \
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
