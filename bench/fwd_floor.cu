// How fast the forward scan's arithmetic alone runs on this GPU, as a bound for kernel designs: the
// tiled kernel's step loop (TPC threads a channel, 16 / TPC states each, B/C broadcast from shared
// memory, the channel's partial outputs summed by shuffles) with no global memory traffic at all,
// over the element count of a shape at dstate 16. The outputs go nowhere. Variants, at TPC 1, 2, 4:
//   core     the recurrence alone (dt, u read from shared memory);
//   scalars  + softplus(delta) and silu(z) once per (channel, step) on the special-function units,
//            as the tiled kernel computes them: a phase per tile, the channel's threads splitting
//            its steps, then a barrier;
//   inline   the same scalars computed in the step loop by every thread of the channel.
// Then `scalars` at TPC 4, 8 and 16 in blocks of 8 to 32 channels: how a scan without a sequence
// split would fare where batch x dim is small (1 x 4096 channels fill the SMs only that way).
// Build and run on the GPU machine:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o fwd_floor bench/fwd_floor.cu
//   ./fwd_floor [batch dim seqlen]      (default 8 4096 2048)
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

namespace {
constexpr int kSteps = 32, kStates = 16;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float lg2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float rcp(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// kScalars: 0 core, 1 scalars (a phase per tile), 2 inline (in the step loop).
template <int kScalars, int kTpc, int kChannels = 64>
__global__ void __launch_bounds__(kChannels * kTpc, 4) floor_kernel(int seqlen, float* sink) {
    constexpr int kThreadStates = kStates / kTpc;
    constexpr int P = kSteps + 1;
    __shared__ __align__(16) float s_B[kSteps * kStates], s_C[kSteps * kStates];
    __shared__ float s_delta[kChannels * P], s_z[kChannels * P], s_u[kChannels * P];
    __shared__ float s_dt[kChannels * P], s_gate[kChannels * P];
    float* s_y = s_z;  // outputs over z: a step's z is read before its shuffles (inline) or a barrier
    const int c = threadIdx.x / kTpc, part = threadIdx.x % kTpc;
    for (int i = threadIdx.x; i < kSteps * kStates; i += blockDim.x) {
        s_B[i] = 0.01f * (i % 7) + 1e-6f * blockIdx.x;
        s_C[i] = 0.02f * (i % 5) - 0.03f;
    }
    for (int i = threadIdx.x; i < kChannels * kSteps; i += blockDim.x) {
        const int row = i / kSteps, t = i % kSteps;
        s_delta[row * P + t] = -3.f + 0.01f * t;
        s_z[row * P + t] = 0.1f * t - 1.f;
        s_u[row * P + t] = 0.1f * (t % 3) - 0.1f;
        s_dt[row * P + t] = 0.05f + 0.001f * t;
        s_gate[row * P + t] = 1.f;
    }
    __syncthreads();
    float a2[kThreadStates], h[kThreadStates];
#pragma unroll
    for (int k = 0; k < kThreadStates; ++k) a2[k] = -float(part * kThreadStates + k + 1) * kLog2e, h[k] = 0.f;
    const float* b_row = s_B + part * kThreadStates;
    for (int l0 = 0; l0 < seqlen; l0 += kSteps) {
        if constexpr (kScalars == 1) {
            // dt = softplus(delta), gate = silu(z): the channel's threads split the tile's steps.
#pragma unroll 4
            for (int j = 0; j < kSteps / kTpc; ++j) {
                const int t = part * (kSteps / kTpc) + j;
                const float x = s_delta[c * P + t] + 1e-9f * l0;
                const float sp = x > 20.f ? x : lg2(1.f + ex2(x * kLog2e)) * (1.f / kLog2e);
                s_dt[c * P + t] = sp;
                const float z = s_z[c * P + t];
                s_gate[c * P + t] = z * rcp(1.f + ex2(-z * kLog2e));
            }
            __syncthreads();
        }
#pragma unroll 2
        for (int t = 0; t < kSteps; ++t) {
            float dt = s_dt[c * P + t], gate = s_gate[c * P + t];
            if constexpr (kScalars == 2) {
                const float x = s_delta[c * P + t] + 1e-9f * l0;
                dt = x > 20.f ? x : lg2(1.f + ex2(x * kLog2e)) * (1.f / kLog2e);
                const float z = s_z[c * P + t];
                gate = z * rcp(1.f + ex2(-z * kLog2e));
            }
            const float dtu = dt * s_u[c * P + t];
            float Bt[kThreadStates], Ct[kThreadStates];
            if constexpr (kThreadStates < 4) {  // 1 or 2 states a thread
#pragma unroll
                for (int k = 0; k < kThreadStates; ++k) Bt[k] = b_row[t * kStates + k], Ct[k] = b_row[t * kStates + k + kSteps * kStates];
            }
#pragma unroll
            for (int q = 0; q < kThreadStates / 4; ++q) {
                const float4 b = *reinterpret_cast<const float4*>(b_row + t * kStates + 4 * q);
                const float4 cv = *reinterpret_cast<const float4*>(b_row + t * kStates + 4 * q + kSteps * kStates);
                Bt[4 * q] = b.x, Bt[4 * q + 1] = b.y, Bt[4 * q + 2] = b.z, Bt[4 * q + 3] = b.w;
                Ct[4 * q] = cv.x, Ct[4 * q + 1] = cv.y, Ct[4 * q + 2] = cv.z, Ct[4 * q + 3] = cv.w;
            }
            float acc[2] = {0.f, 0.f};
#pragma unroll
            for (int k = 0; k < kThreadStates; ++k) {
                h[k] = fmaf(ex2(dt * a2[k]), h[k], dtu * Bt[k]);
                acc[k % 2] = fmaf(Ct[k], h[k], acc[k % 2]);
            }
            float y = acc[0] + acc[1];
#pragma unroll
            for (int m = 1; m < kTpc; m *= 2) y += __shfl_xor_sync(0xffffffffu, y, m);
            if (part == 0) s_y[c * P + t] = y * gate;
        }
        __syncthreads();
    }
    float sum = s_y[c * P];
#pragma unroll
    for (int k = 0; k < kThreadStates; ++k) sum += h[k];
    sink[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}
}  // namespace

int main(int argc, char** argv) {
    const long long batch = argc > 3 ? atoll(argv[1]) : 8, dim = argc > 3 ? atoll(argv[2]) : 4096;
    const int seqlen = argc > 3 ? atoi(argv[3]) : 2048;
    if (batch * dim % 64 != 0) return fprintf(stderr, "batch x dim: a multiple of 64\n"), 2;
    float* sink;  // a float a thread, up to 16 threads a channel
    if (cudaMalloc(&sink, size_t(batch * dim) * 16 * 4) != cudaSuccess) return 1;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    int clock_khz = 0, sms = 0;
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    const double elements = double(batch) * dim * seqlen * kStates;
    auto run = [&](const char* name, auto kernel, int tpc, int channels = 64) {
        const unsigned blocks = unsigned(batch * dim / channels);
        for (int i = 0; i < 3; ++i) kernel<<<blocks, channels * tpc>>>(seqlen, sink);
        cudaEventRecord(e0);
        const int iters = 10;
        for (int i = 0; i < iters; ++i) kernel<<<blocks, channels * tpc>>>(seqlen, sink);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms = 0.f;
        cudaEventElapsedTime(&ms, e0, e1);
        const double us = ms * 1000.0 / iters;
        // One ex2 per element on 16 special-function lanes an SM, at the device's rated clock.
        const double floor_us = elements / (16.0 * sms * clock_khz * 1e3) * 1e6;
        printf("%-8s tpc %2d, %2d channels a block, %lldx%lldx%dx16: %8.1f us; one ex2 an element at %d MHz: %.1f us (%.0f%%)\n",
               name, tpc, channels, batch, dim, seqlen, us, clock_khz / 1000, floor_us, 100.0 * floor_us / us);
    };
    run("core", floor_kernel<0, 2>, 2);
    run("scalars", floor_kernel<1, 2>, 2);
    run("inline", floor_kernel<2, 2>, 2);
    run("core", floor_kernel<0, 1>, 1);
    run("scalars", floor_kernel<1, 1>, 1);
    run("inline", floor_kernel<2, 1>, 1);
    run("core", floor_kernel<0, 4>, 4);
    run("scalars", floor_kernel<1, 4>, 4);
    run("scalars", floor_kernel<1, 4, 16>, 4, 16);
    run("scalars", floor_kernel<1, 8, 16>, 8, 16);
    run("scalars", floor_kernel<1, 8, 32>, 8, 32);
    run("scalars", floor_kernel<1, 16, 8>, 16, 8);
    run("scalars", floor_kernel<1, 16, 16>, 16, 16);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return fprintf(stderr, "%s\n", cudaGetErrorString(e)), 1;
    return 0;
}
