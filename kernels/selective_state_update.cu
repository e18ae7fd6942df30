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
// a thread per state vector, every load of its row issued before any arithmetic, and few
// instructions per row, so that the kernel runs near the HBM copy rate (BENCHMARKS.md, "Limits"). The grid
// is two-dimensional, so that no thread divides by dim: block (x, y) takes channels
// [x * per_block, (x + 1) * per_block) of batch rows y, y + gridDim.y, ... Rows past dim return at
// once (a row's lanes sum over the row's own shuffle mask). `kFused`: the conv first (decode_step's
// conv half), lane k < width holding tap k (the host takes this path only when lanes >= width) and
// writing it back one place older, so that no lane waits for another's load.
constexpr int kFastBlock = 128;  // measured best on the H100
// Resident blocks asked of the compiler for the state update with an f32 state: 40 registers, so
// 1536 threads per SM (45 and 1280 without; a half state would spill at 40).
template <typename S>
constexpr int kFastMinBlocks = sizeof(S) == 4 ? 12 : 1;

template <typename T, typename W, typename S, typename WT, bool kFused>
__device__ __forceinline__ void rows_fast(const DecodeParams q) {
    const StateUpdateParams& p = q.ssm;
    constexpr int kN = 16 / sizeof(S);
    const int lanes = p.lanes;
    const int lane = threadIdx.x & (lanes - 1);
    // lanes is a power of two dividing blockDim.x: a shift, not a division.
    const int64_t d = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> (__ffs(lanes) - 1);
    if (d >= p.dim) return;
    const unsigned mask = row_mask(lanes);
    const int64_t n = (int64_t)lane * kN;
    const int64_t group = p.groups == 1 ? 0 : d / p.dim_per_group;
    float a[kN], dt_bias = 0.f, skip_coef = 0.f;
    load_n<kN, false>(p.A + d * p.dstate + n, kN, true, a);
    if (p.dt_bias) dt_bias = __ldg(p.dt_bias + d);
    if (p.D && lane == 0) skip_coef = __ldg(p.D + d);
    // The conv: this lane's tap weight (0 past the width) and, on the first lane, the bias.
    const int w = kFused ? (int)q.width : 0;
    float tap_weight = 0.f, conv_bias = 0.f;
    if (kFused) {
        if (lane < w) tap_weight = to_f32(static_cast<const WT*>(q.conv_weight)[d * w + lane]);
        if (q.conv_bias && lane == 0) conv_bias = to_f32(static_cast<const WT*>(q.conv_bias)[d]);
    }
    for (int64_t b = blockIdx.y; b < p.batch; b += gridDim.y) {
        const int64_t row = b * p.dim + d;
        const int64_t slot = slot_of(p.state_batch_indices, b);
        if (slot < 0 || slot >= p.n_slots) {  // padding: output 0, no state touched
            if (lane == 0) static_cast<T*>(p.out)[row] = from_f32<T>(0.f);
            continue;
        }
        const int64_t slot_row = slot * p.dim + d;
        const int64_t bc = (b * p.groups + group) * p.dstate + n;
        S* state = static_cast<S*>(p.state) + slot_row * p.dstate + n;
        float h[kN], bv[kN], cv[kN];
        load_n<kN, true>(state, kN, true, h);
        load_n<kN, false>(static_cast<const W*>(p.B) + bc, kN, true, bv);
        load_n<kN, false>(static_cast<const W*>(p.C) + bc, kN, true, cv);
        float x = to_f32(static_cast<const T*>(p.x)[row]);
        const float dt = to_f32(static_cast<const T*>(p.dt)[row]) + dt_bias;
        const float z = p.z && lane == 0 ? to_f32(static_cast<const T*>(p.z)[row]) : 0.f;
        T* conv_state = kFused ? static_cast<T*>(q.conv_state) + slot_row * (w - 1) : nullptr;
        const float old_tap = kFused && lane < w - 1 ? to_f32(conv_state[lane]) : 0.f;
        if (kFused) {
            // Tap w - 1 is the new input. The sum's shuffles order every lane's load of the conv
            // state before any lane's store; the state keeps taps 1..w-1.
            const float tap = lane == w - 1 ? x : old_tap;
            const float conv = row_sum(fmaf(tap_weight, tap, conv_bias), lanes, mask);
            if (lane >= 1 && lane < w) conv_state[lane - 1] = from_f32<T>(tap);
            x = silu_fast(conv);
        }
        const float dtv = p.dt_softplus ? softplus_fast(dt) : dt;
        const float dt2 = dtv * kLog2e, dtx = dtv * x;
        float y = 0.f;
#pragma unroll
        for (int k = 0; k < kN; ++k) {
            // The output reads the state as stored (see update_states).
            h[k] = to_f32(from_f32<S>(fmaf(ex2_ftz(dt2 * a[k]), h[k], dtx * bv[k])));
            y = fmaf(cv[k], h[k], y);
        }
        store_n<kN>(state, kN, true, h);
        y = row_sum(y, lanes, mask);
        if (lane == 0) {
            if (p.D) y = fmaf(skip_coef, x, y);
            if (p.z) y *= silu_fast(z);
            static_cast<T*>(p.out)[row] = from_f32<T>(y);
        }
    }
}

#define SSU(T, W, S)                                                                                   \
    extern "C" __global__ void __launch_bounds__(1024) selective_state_update_##T##_##W##_##S(         \
        const StateUpdateParams p) {                                                                   \
        state_update<T, W, S>(p);                                                                      \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kFastBlock, kFastMinBlocks<S>)                        \
        selective_state_update_##T##_##W##_##S##_fast(                                                 \
        const StateUpdateParams p) {                                                                   \
        rows_fast<T, W, S, T, false>(DecodeParams{p, nullptr, nullptr, nullptr, 0});                  \
    }
#define DECODE(T, W, S, WT)                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) mamba_decode_step_##T##_##W##_##S##_##WT(       \
        const DecodeParams q) {                                                                        \
        decode_step<T, W, S, WT>(q);                                                                   \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(kFastBlock) mamba_decode_step_##T##_##W##_##S##_##WT##_fast( \
        const DecodeParams q) {                                                                        \
        rows_fast<T, W, S, WT, true>(q);                                                               \
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
