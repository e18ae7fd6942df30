// Hopper warpgroup MMA (wgmma.mma_async) for the SSD kernels (ssd_fwd_wgmma.cuh, ssd_local_wgmma.cuh,
// and ssd_bwd.cu's head sums):
// shared-memory matrix descriptors for 128-byte-swizzled tiles, and the three shapes the kernels
// issue. A block of 128 threads is one warpgroup; accumulators use mma.sync's layout per warp (warp w:
// rows 16w..16w+15).
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace wgmma {

// Tiles of 64-element (128-byte) rows of 2-byte elements: element (r, c) of a [rows][64] block sits
// at byte r * 128 + ((c / 8) ^ (r % 8)) * 16 + (c % 8) * 2 (the hardware's 128-byte swizzle, which
// needs the block 1024-byte aligned). Wider tiles are such blocks one after another.
__host__ __device__ constexpr uint32_t swizzled(int r, int c) {
    return uint32_t(r) * 128u + uint32_t(((c >> 3) ^ (r & 7)) << 4) + uint32_t(c & 7) * 2u;
}

// A tile of 64 rows and any multiple of 64 columns as such blocks one after another, 1024-byte aligned:
// the byte of element (row, col).
constexpr int kBlockBytes = 64 * 128;
__host__ __device__ constexpr uint32_t tile_byte(int row, int col) {
    return uint32_t(col / 64) * kBlockBytes + swizzled(row, col % 64);
}
// The first 1024-byte boundary of the shared window at or after p (dynamic shared memory is only
// 16-byte aligned; the launchers give 1024 bytes of slack).
__device__ __forceinline__ unsigned char* align_1024(unsigned char* p) {
    const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    return p + (((at + 1023) & ~1023u) - at);
}
// Descriptor strides of such tiles: MN-major operands step kLbo from one 64-element block to the
// next; 8-row groups lie kSbo apart.
constexpr uint32_t kLbo = kBlockBytes, kSbo = 8 * 128;

// A descriptor of a 128-byte-swizzled operand at shared address `addr`; adding bytes / 16 moves it.
// K-major (k contiguous): `sbo` = bytes from one 8-row group to the next, `lbo` unused. MN-major:
// `lbo` = bytes from one 64-element block of M/N to the next, `sbo` = from one 8-row group of K to the next.
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Shared-memory writes by threads (st.shared, cp.async) become visible to wgmma's operand reads.
__device__ __forceinline__ void fence_shared_to_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Pins accumulators in place around an asynchronous wgmma, so the compiler neither reads them early
// nor moves their updates across the wait.
template <int J> __device__ __forceinline__ void pin(float (&d)[J][4]) {
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

// The three shapes, for one element type (TY: its PTX name). The A-in-registers forms always
// accumulate (scale-d is a predicate operand, set from a constant).
#define WGMMA_OPS(CTYPE, TY)                                                                          \
    template <> struct Ops<CTYPE> {                                                                   \
        /* d (64 x 64) (+)= A (64 x 16, K-major at da) B (16 x 64, K-major at db). */                 \
        static __device__ __forceinline__ void ss_n64(float (&d)[8][4], uint64_t da, uint64_t db, bool accumulate) { \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                \
                         "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
                         : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
                         : "l"(da), "l"(db), "r"(int(accumulate)));                                \
        }                                                                                             \
        /* d (64 x 64) += A (64 x 16, registers as mma.sync's A fragments) B (16 x 64 at db: N-major, or \
           K-major with N_MAJOR false). */                                                              \
        template <bool N_MAJOR = true>                                                                \
        static __device__ __forceinline__ void rs_n64(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db) { \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                \
                         "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n" \
                         : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1), "n"(int(N_MAJOR))); \
        }                                                                                             \
        /* d (64 x 128) += A (64 x 16, registers as mma.sync's A fragments) B (16 x 128, N-major at db). */ \
        static __device__ __forceinline__ void rs_n128(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db) { \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                \
                         "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
                         : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));          \
        }                                                                                             \
    };
template <typename T> struct Ops;
WGMMA_OPS(__nv_bfloat16, "bf16")
WGMMA_OPS(__half, "f16")
#undef WGMMA_OPS

}  // namespace wgmma
