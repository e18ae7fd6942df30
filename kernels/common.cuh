// Shared device helpers: element conversion and the scalar functions every SSM kernel uses.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;
typedef __half f16;
typedef float f32;

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(f16 x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ f16 from_f32<f16>(float x) { return __float2half_rn(x); }

// log(1 + e^x), linear past 20 where the difference is below f32 resolution.
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared; zero-filled when !valid (src must still be a mapped address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
// The dynamic shared memory the block was launched with.
__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
    uint32_t v;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
    return v;
}
// Waits until at most N of this thread's cp.async groups are pending.
template <int N> __device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// body(i, stage) for i in [0, n), the block's copies for item i issued STAGES - 1 items ahead by
// load(i, stage) (cp.async only; one commit group per item) into ring slot `stage`. ASYNC_READS: the
// body reads the copies with the async proxy (wgmma operands), so each thread fences its landed copies
// toward it before the barrier.
template <int STAGES, bool ASYNC_READS = false, typename Load, typename Body>
__device__ __forceinline__ void cp_async_pipeline(int64_t n, Load load, Body body) {
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n) load(int64_t(s), s);
        cp_async_commit();
    }
    for (int64_t i = 0; i < n; ++i) {
        const int64_t next = i + STAGES - 1;
        if (next < n) load(next, int(next % STAGES));
        cp_async_commit();
        cp_async_wait_group<STAGES - 1>();
#if __CUDA_ARCH__ >= 900
        if constexpr (ASYNC_READS) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
        __syncthreads();
        body(i, int(i % STAGES));
        __syncthreads();  // before a later load refills this slot
    }
}
// 4 bytes global -> shared (through L1: .ca is the only form for 4-byte copies); zero-filled when !valid.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0));
}
// Waits for every cp.async this thread issued (its own copies are then visible to it).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// Programmatic dependent launch (sm_90+; elsewhere no-ops): the kernel launched after this one with
// the programmatic-serialization attribute may start once every block of this one has signalled...
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}
// ...and this waits until the kernel before it in the stream has finished, its writes visible.
__device__ __forceinline__ void pdl_wait_prerequisite() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Pulls the 128-byte line holding p into L2 (no register result: nothing waits on it). For loads a
// block issues only when it needs them (single-buffered tiles), one tile ahead.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
__device__ __forceinline__ float ex2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// softplus(x) = ln(1 + e^x) and silu(x) = x / (1 + e^-x) in a few instructions (log1pf is ~30, and
// the scans' per-step scalars were a quarter of their issue slots).
// softplus(x) = max(x, 0) + ln(1 + t), t = e^-|x| in (0, 1], and ln(1 + t) = t P(t) with P a degree-7
// fit on the FMA pipes (relative error < 3.1e-7 in f32 over [0, 1]; the CPU target, cpu.rs, has the
// same form with degree 8): one special-function op, where the forward's special-function pipe is
// its busiest (the form before, lg2(1 + e^x) with a series below e^x = 1/16, took two and erred up
// to 3e-6). Exact to f32 for tiny dt (x << 0: t P(t) ~ t; tests:
// tiny_dt_f32) and for large x (x + tiny).
// (silu's reciprocal on the FMA pipes, by two Newton steps, or four gates' reciprocals from one,
// made the forward slower: it issues about as many instructions as the special-function unit allows;
// BENCHMARKS.md, "What did not pay".)
__device__ __forceinline__ float exp_neg_abs(float x) { return ex2_ftz(-fabsf(x) * kLog2e); }
__device__ __forceinline__ float softplus_from_t(float x, float t) {
    float p = -8.538360707461834e-3f;
    p = fmaf(p, t, 4.408564046025276e-2f);
    p = fmaf(p, t, -1.0767453163862228e-1f);
    p = fmaf(p, t, 1.7744603753089905e-1f);
    p = fmaf(p, t, -2.4495168030261993e-1f);
    p = fmaf(p, t, 3.3275410532951355e-1f);
    p = fmaf(p, t, -4.9997398257255554e-1f);
    p = fmaf(p, t, 9.999998211860657e-1f);
    return fmaxf(x, 0.f) + t * p;
}
__device__ __forceinline__ float softplus_fast(float x) { return softplus_from_t(x, exp_neg_abs(x)); }
__device__ __forceinline__ float silu_fast(float x) { return __fdividef(x, 1.f + ex2_ftz(-x * kLog2e)); }
