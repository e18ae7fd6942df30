// An experiment, not used by the library (BENCHMARKS.md, stops 42 and 43): the forward at one
// thread a channel, warp-specialized. Timed by bench/fwd_variants.cu (SSF_WS=1 or 2, and
// SSF_WS_SCALARS for kScalars below). Only what that
// harness runs: bf16, dstate 16, time-varying B/C as 16-byte vectors, z and softplus on, no
// checkpoints, no sequence split.
//
// A block is two warpgroups. The first scans: 128 channels, a thread and 16 states each, the step
// loop of kernels/selective_scan_fwd.cu at TPC 1, with nothing per tile but two named barriers.
// The second moves tiles through two stage buffers: it issues tile k's loads into registers, waits
// until the scan is done with the stage tile k - 2 used, stores that tile's outputs from it, unpacks
// tile k into it and marks it full. setmaxnreg moves registers from the movers (88) to the scanners
// (168), so that two blocks fit an SM. The grid is persistent (two blocks an SM): block i takes the
// units (128-channel tile, batch row) vb, vb + grid, ... With kSmOrder, vb is SM-major (a per-SM
// arrival rank from an atomic counter), so that the units past the first round go one an SM
// before any SM gets two: the blocks of back-to-back launches land on SMs in the order the last
// launch freed them, and in blockIdx order the extra units doubled up on some SMs. (That mapping
// is a bijection only when every SM holds the same number of blocks: fine for an experiment, not
// for the library.)
#pragma once
#include "../kernels/selective_scan_fwd.cu"

__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void named_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }

// kScalars: where dt = softplus(delta + bias) and the gate silu(z) are computed. 0: by the scanning
// threads, in the step loop (the library's way). Otherwise by the movers as they unpack a tile, into
// f32 rows the scanners read: 1 with the special-function forms (softplus_fast, silu_fast), 2 with
// both on the FMA pipes (exp2_fma, a Newton reciprocal), 3 softplus on the special-function unit and
// silu on the FMA pipes.
template <int kScalars> struct WsShape {
    static constexpr int kChannels = 128, kMovers = 128, kThreads = kChannels + kMovers;
    static constexpr int kBlocksPerSm = 2;
    static constexpr int S = 32, P = 34, N = 16, E = 8;  // bf16: steps a tile, row pitch, states, a vector
    static constexpr int PF = 33;                        // pitch of the f32 dt and gate rows
    // A stage: B, C [S][N] f32, then u (outputs back) [channels][P] bf16, then delta, z [channels][P]
    // bf16 (kScalars 0) or dt, gate [channels][PF] f32.
    static constexpr int kScalarBytes = kScalars ? 2 * kChannels * PF * 4 : 2 * kChannels * P * 2;
    static constexpr int kStageBytes = 2 * S * N * 4 + kChannels * P * 2 + kScalarBytes;
    static constexpr int kSharedBytes = 2 * kStageBytes;
};

// 1 / d for d in [1, 2] on the FMA pipes: a linear start (relative error <= 1/17), three Newton steps.
__device__ __forceinline__ float rcp_1_2_fma(float d) {
    float r = fmaf(-8.f / 17.f, d, 24.f / 17.f);
#pragma unroll
    for (int i = 0; i < 3; ++i) r = fmaf(r, fmaf(-d, r, 1.f), r);
    return r;
}
template <int kScalars> __device__ __forceinline__ float ws_softplus(float x) {
    if constexpr (kScalars == 2) return softplus_from_t(x, exp2_fma(-fabsf(x) * kLog2e));
    else return softplus_fast(x);
}
template <int kScalars> __device__ __forceinline__ float ws_silu(float x) {
    if constexpr (kScalars == 1) return silu_fast(x);
    else {
        const float t = exp2_fma(-fabsf(x) * kLog2e);  // x sigmoid(x), sigmoid from t = e^-|x|
        return x * (x >= 0.f ? 1.f : t) * rcp_1_2_fma(1.f + t);
    }
}

__device__ unsigned int g_ws_sm_rank[1024];

template <bool kSmOrder, int kScalars> __device__ __forceinline__ void selective_scan_fwd_ws(const SelectiveScanFwdParams& p) {
    using T = bf16;
    using Sh = WsShape<kScalars>;
    constexpr int C = Sh::kChannels, S = Sh::S, P = Sh::P, N = Sh::N, E = Sh::E, K = 16, G = 4, kStages = 2;
    constexpr int kThreads = Sh::kThreads, PT = Sh::kMovers;
    extern __shared__ __align__(16) unsigned char shared[];
    auto stage_B = [&](int s) { return reinterpret_cast<float*>(shared + s * Sh::kStageBytes); };
    auto stage_u = [&](int s) { return reinterpret_cast<T*>(shared + s * Sh::kStageBytes + 2 * S * N * 4); };
    // kScalars > 0: dt rows, then gate rows, after u.
    auto stage_dt = [&](int s) { return reinterpret_cast<float*>(stage_u(s) + C * P); };
    constexpr int PF = Sh::PF;

    const int tid = threadIdx.x;
    const int64_t L = p.seqlen;
    const int n_tiles = int((L + S - 1) / S);
    const bool time_contiguous = p.x_stride_seq == 1, bc_time_contiguous = p.bc_stride_seq == 1;
    const int tiles_per_row = int((p.dim + C - 1) / C), units = tiles_per_row * int(p.batch);
    __shared__ int s_vb;
    uint32_t sm_id = 0;
    if (tid == 0) {
        s_vb = int(blockIdx.x);
        if (kSmOrder && units > int(gridDim.x)) {
            uint32_t nsm;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_id));
            asm volatile("mov.u32 %0, %%nsmid;" : "=r"(nsm));
            s_vb = int(atomicAdd(&g_ws_sm_rank[sm_id], 1u)) * int(nsm) + int(sm_id);
        }
    }
    __syncthreads();
    const int vb = s_vb;
    const int n_items = vb < units ? (units - vb + int(gridDim.x) - 1) / int(gridDim.x) * n_tiles : 0;

    struct Unit {
        int64_t b, d0, x_base, bc_base;
        int rows;
    };
    auto unit_at = [&](int u) {
        Unit it;
        it.b = u / tiles_per_row, it.d0 = int64_t(u % tiles_per_row) * C;
        it.rows = int(min(int64_t(C), p.dim - it.d0));
        it.x_base = it.b * p.x_stride_batch + it.d0 * p.x_stride_dim;
        it.bc_base = it.b * p.bc_stride_batch + (it.d0 / p.dim_per_group) * p.bc_stride_group;
        return it;
    };
    // Walks this block's tiles in order (a division a tile cost the movers ~7% of the kernel).
    struct Cursor {
        int k, u;
        Unit it;
    };
    auto cursor_next = [&](Cursor& cur) {
        if (++cur.k == n_tiles) {
            cur.k = 0, cur.u += int(gridDim.x);
            if (cur.u < units) cur.it = unit_at(cur.u);
        }
    };

    if (tid >= C) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 88;\n" ::: "memory");
        const int lane = tid - C;
        const T* u = static_cast<const T*>(p.u);
        const T* delta = static_cast<const T*>(p.delta);
        const T* z = static_cast<const T*>(p.z);
        T* out = static_cast<T*>(p.out);
        const T* Bm = static_cast<const T*>(p.B);
        const T* Cm = static_cast<const T*>(p.C);
        constexpr int kVecs = C * S / E, kPerLane = kVecs / PT;  // vectors a tensor tile, a mover
        constexpr int kBcVecs = S * N / E, kBcPerLane = (kBcVecs + PT - 1) / PT;
        auto where = [&](int v, int& r, int& t) {  // vector v of a [C][S] tile: its row and step
            r = time_contiguous ? v / (S / E) : (v % (C / E)) * E;
            t = time_contiguous ? (v % (S / E)) * E : v / (C / E);
        };
        auto where_bc = [&](int v, int& n, int& t) {
            n = bc_time_contiguous ? v / (S / E) : (v % (N / E)) * E;
            t = bc_time_contiguous ? (v % (S / E)) * E : v / (N / E);
        };
        uint4 vx[3][kPerLane], vB[kBcPerLane], vC[kBcPerLane];
        Cursor in_cur{0, vb, unit_at(vb)}, out_cur = in_cur;
        int64_t loaded_d0 = 0;  // the unit of the tile in the registers (for delta_bias)
        int loaded_rows = 0;
        auto load = [&]() {  // tile in_cur's loads into registers, zeros outside the tensors
            const Unit& it = in_cur.it;
            loaded_d0 = it.d0, loaded_rows = it.rows;
            const int64_t l0 = int64_t(in_cur.k) * S;
            const int steps = int(min(int64_t(S), L - l0));
            const T* xs[3] = {u, delta, z};
#pragma unroll
            for (int x = 0; x < 3; ++x)
#pragma unroll
                for (int j = 0; j < kPerLane; ++j) {
                    int r, t;
                    where(j * PT + lane, r, t);
                    vx[x][j] = r < it.rows && t < steps
                                   ? __ldg(reinterpret_cast<const uint4*>(xs[x] + it.x_base + r * p.x_stride_dim + (l0 + t) * p.x_stride_seq))
                                   : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
            for (int j = 0; j < kBcPerLane; ++j) {
                const int v = j * PT + lane;
                int n, t;
                where_bc(v, n, t);
                const bool in = v < kBcVecs && n < p.dstate && t < steps;
                const int64_t gi = it.bc_base + n * p.bc_stride_state + (l0 + t) * p.bc_stride_seq;
                vB[j] = in ? __ldg(reinterpret_cast<const uint4*>(Bm + gi)) : make_uint4(0, 0, 0, 0);
                vC[j] = in ? __ldg(reinterpret_cast<const uint4*>(Cm + gi)) : make_uint4(0, 0, 0, 0);
            }
        };
        auto unpack = [&](int s) {  // the registers into stage s
            T* su = stage_u(s);
#pragma unroll
            for (int x = 0; x < 3; ++x)
#pragma unroll
                for (int j = 0; j < kPerLane; ++j) {
                    int r, t;
                    where(j * PT + lane, r, t);
                    T* dst = su + x * C * P;
                    if (kScalars && x > 0) {  // dt or the gate, as f32
                        float* df = stage_dt(s) + (x - 1) * C * PF;
                        const T* e = reinterpret_cast<const T*>(&vx[x][j]);
                        const float* bias = p.delta_bias ? p.delta_bias + loaded_d0 : nullptr;
                        const float row_bias = time_contiguous && bias && r < loaded_rows ? __ldg(bias + r) : 0.f;
#pragma unroll
                        for (int i = 0; i < E; ++i) {
                            const int ri = time_contiguous ? r : r + i, ti = time_contiguous ? t + i : t;
                            const float v = to_f32(e[i]);
                            float f;
                            if (x == 1) {
                                const float b = time_contiguous ? row_bias : bias && ri < loaded_rows ? __ldg(bias + ri) : 0.f;
                                f = ws_softplus<kScalars>(v + b);
                            } else {
                                f = ws_silu<kScalars>(v);
                            }
                            df[ri * PF + ti] = f;
                        }
                        continue;
                    }
                    if (time_contiguous) {
                        uint32_t* w = reinterpret_cast<uint32_t*>(dst + r * P + t);
                        w[0] = vx[x][j].x, w[1] = vx[x][j].y, w[2] = vx[x][j].z, w[3] = vx[x][j].w;
                    } else {
                        const T* e = reinterpret_cast<const T*>(&vx[x][j]);
#pragma unroll
                        for (int i = 0; i < E; ++i) dst[(r + i) * P + t] = e[i];
                    }
                }
            float* sB = stage_B(s);
#pragma unroll
            for (int j = 0; j < kBcPerLane; ++j) {
                const int v = j * PT + lane;
                if (v >= kBcVecs) break;
                int n, t;
                where_bc(v, n, t);
                const T* eb = reinterpret_cast<const T*>(&vB[j]);
                const T* ec = reinterpret_cast<const T*>(&vC[j]);
                const int step = bc_time_contiguous ? N : 1;
#pragma unroll
                for (int i = 0; i < E; ++i) {
                    sB[t * N + n + i * step] = to_f32(eb[i]);
                    sB[S * N + t * N + n + i * step] = to_f32(ec[i]);
                }
            }
        };
        auto store_outputs = [&](int s) {  // tile out_cur's outputs, over its u in stage s
            const T* su = stage_u(s);
            const Unit& it = out_cur.it;
            const int64_t l0 = int64_t(out_cur.k) * S;
            const int steps = int(min(int64_t(S), L - l0));
#pragma unroll
            for (int j = 0; j < kPerLane; ++j) {
                int r, t;
                where(j * PT + lane, r, t);
                if (r >= it.rows || t >= steps) continue;
                uint4 v;
                if (time_contiguous) {
                    const uint32_t* w = reinterpret_cast<const uint32_t*>(su + r * P + t);
                    v = make_uint4(w[0], w[1], w[2], w[3]);
                } else {
                    T* e = reinterpret_cast<T*>(&v);
#pragma unroll
                    for (int i = 0; i < E; ++i) e[i] = su[(r + i) * P + t];
                }
                __stcg(reinterpret_cast<uint4*>(out + it.x_base + r * p.x_stride_dim + (l0 + t) * p.x_stride_seq), v);
            }
        };
        for (int k = 0; k < n_items + kStages; ++k) {
            const int s = k % kStages;
            if (k < n_items) load(), cursor_next(in_cur);  // in flight while the stage is emptied
            if (k >= kStages) {
                named_sync(1 + kStages + s, kThreads);  // "empty": the scan is done with tile k - 2
                store_outputs(s);
                cursor_next(out_cur);
            }
            if (k < n_items) {
                unpack(s);
                named_arrive(1 + s, kThreads);  // "full"
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 168;\n" ::: "memory");
    const int c = tid;
    bool active = false;
    int64_t state_base = 0;
    float a2[K], h[K], bias = 0.f, skip = 0.f;
    struct StepIn {
        float u, dt, gate;
        float4 b[K / 4], c[K / 4];
    };
    Cursor cur{0, vb, unit_at(vb)};
    for (int f = 0; f < n_items; ++f, cursor_next(cur)) {
        const int s = f % kStages, k = cur.k;
        const int steps = int(min(int64_t(S), L - int64_t(k) * S));
        if (k == 0) {  // a new unit: this thread's channel
            active = c < cur.it.rows;
            const int64_t d = cur.it.d0 + (active ? c : 0);
            state_base = (cur.it.b * p.dim + d) * p.dstate;
#pragma unroll
            for (int i = 0; i < K; ++i) {
                const bool valid = active && i < p.dstate;
                a2[i] = valid ? p.A[d * p.dstate + i] * kLog2e : 0.f;
                h[i] = valid && p.initial_state ? p.initial_state[state_base + i] : 0.f;
            }
            bias = active && p.delta_bias ? p.delta_bias[d] : 0.f;
            skip = active && p.D ? p.D[d] : 0.f;
        }
        named_sync(1 + s, kThreads);  // "full"
        T* u_at = stage_u(s) + c * P;
        const float* dt_at = stage_dt(s) + c * PF;
        const float* bc_at = stage_B(s);
        auto read_step = [&](int i) {  // step i of the group (one past the tile stays in the stage)
            StepIn in;
            in.u = to_f32(u_at[i]);
            if constexpr (kScalars) {
                in.dt = dt_at[i];
                in.gate = dt_at[i + C * PF];
            } else {
                in.dt = softplus_fast(to_f32(u_at[i + C * P]) + bias);
                in.gate = silu_fast(to_f32(u_at[i + 2 * C * P]));
            }
#pragma unroll
            for (int q = 0; q < K / 4; ++q) {
                in.b[q] = *reinterpret_cast<const float4*>(bc_at + i * N + 4 * q);
                in.c[q] = *reinterpret_cast<const float4*>(bc_at + i * N + 4 * q + S * N);
            }
            return in;
        };
        StepIn next = read_step(0);
        for (int g = 0; g < (steps + G - 1) / G; ++g) {
            float partial[G], gate[G];
            const int left = steps - g * G;
#pragma unroll
            for (int i = 0; i < G; ++i) {
                const StepIn now = next;
                next = read_step(i + 1);
                const float dt = i >= left ? 0.f : now.dt;
                gate[i] = now.gate;
                const float dtu = dt * now.u;
                const float* Bt = reinterpret_cast<const float*>(now.b);
                const float* Ct = reinterpret_cast<const float*>(now.c);
                float acc[2] = {0.f, 0.f};
#pragma unroll
                for (int n = 0; n < K; ++n) {
                    h[n] = fmaf(ex2_ftz(dt * a2[n]), h[n], dtu * Bt[n]);
                    acc[n % 2] = fmaf(Ct[n], h[n], acc[n % 2]);
                }
                partial[i] = acc[0] + acc[1];
            }
#pragma unroll
            for (int e = 0; e < G; ++e) u_at[e] = from_f32<T>(fmaf(skip, to_f32(u_at[e]), partial[e]) * gate[e]);
            u_at += G, dt_at += G, bc_at += G * N;
        }
        named_arrive(1 + kStages + s, kThreads);  // "empty"
        if (k == n_tiles - 1 && active)
#pragma unroll
            for (int i = 0; i < K; ++i)
                if (i < p.dstate) p.final_state[state_base + i] = h[i];
    }
    if (kSmOrder && tid == 0 && units > int(gridDim.x)) atomicSub(&g_ws_sm_rank[sm_id], 1u);
}

// selective_scan_fwd_ws[_sm_order]_scalars<kScalars>_bf16
#define SSF_WS_KERNEL(NAME, ORDER, SCALARS)                                                       \
    extern "C" __global__ void __launch_bounds__(WsShape<SCALARS>::kThreads, WsShape<SCALARS>::kBlocksPerSm) \
        NAME(const SelectiveScanFwdParams p) {                                                    \
        selective_scan_fwd_ws<ORDER, SCALARS>(p);                                                 \
    }
#define SSF_WS_KERNELS(SCALARS)                                                          \
    SSF_WS_KERNEL(selective_scan_fwd_ws_scalars##SCALARS##_bf16, false, SCALARS)         \
    SSF_WS_KERNEL(selective_scan_fwd_ws_sm_order_scalars##SCALARS##_bf16, true, SCALARS)
SSF_WS_KERNELS(0)
SSF_WS_KERNELS(1)
SSF_WS_KERNELS(2)
SSF_WS_KERNELS(3)
