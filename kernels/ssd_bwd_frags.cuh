// mma fragment and shared-tile helpers of the tensor-core SSD backward (ssd_bwd_mma.cuh's main kernel,
// ssd_bwd_sums.cuh's head sums): A fragments formed from accumulators and scaled by row, row dots, and
// the products and copies the main kernel's warps make from shared tiles.
#pragma once
#include "ssd_mma.cuh"

namespace ssd_mma {

// A fragments (m16 x k16) from a row block of f32 accumulators over two n-tiles.
template <typename T> __device__ __forceinline__ void to_a_frag(uint32_t a[4], const float* lo, const float* hi) {
    a[0] = pack_u32<T>(lo[0], lo[1]);
    a[1] = pack_u32<T>(lo[2], lo[3]);
    a[2] = pack_u32<T>(hi[0], hi[1]);
    a[3] = pack_u32<T>(hi[2], hi[3]);
}
// Scales the rows (lane/4 and lane/4 + 8) of an A fragment.
template <typename T> __device__ __forceinline__ void scale_a_rows(uint32_t a[4], float lo, float hi) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const float2 v = Ops<T>::unpack2(*reinterpret_cast<const typename Ops<T>::T2*>(&a[r]));
        const float f = r & 1 ? hi : lo;
        a[r] = pack_u32<T>(v.x * f, v.y * f);
    }
}
// The same in T arithmetic (one rounding per element: the factors are <= 1).
template <typename T> __device__ __forceinline__ void scale_a_rows_t2(uint32_t a[4], float lo, float hi) {
    using T2 = typename Ops<T>::T2;
    const T2 f[2] = {Ops<T>::pack2(lo, lo), Ops<T>::pack2(hi, hi)};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const T2 v = __hmul2(*reinterpret_cast<const T2*>(&a[r]), f[r & 1]);
        a[r] = *reinterpret_cast<const uint32_t*>(&v);
    }
}
// The same with f split into two T parts (hi = f rounded, lo = f - hi rounded): fma(a, hi, a lo) is
// within about one rounding of the f32 product, in two T-pair instructions a register instead of
// scale_a_rows' five (unpack, two multiplies, pack).
template <typename T> __device__ __forceinline__ void scale_a_rows_split(uint32_t a[4], float lo, float hi) {
    using T2 = typename Ops<T>::T2;
    const T2 lo_hi = Ops<T>::pack2(lo, lo), hi_hi = Ops<T>::pack2(hi, hi);
    const float2 lo_r = Ops<T>::unpack2(lo_hi), hi_r = Ops<T>::unpack2(hi_hi);
    const T2 f_hi[2] = {lo_hi, hi_hi}, f_lo[2] = {Ops<T>::pack2(lo - lo_r.x, lo - lo_r.x), Ops<T>::pack2(hi - hi_r.x, hi - hi_r.x)};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const T2 v = *reinterpret_cast<const T2*>(&a[r]);
        const T2 out = __hfma2(v, f_hi[r & 1], __hmul2(v, f_lo[r & 1]));
        a[r] = *reinterpret_cast<const uint32_t*>(&out);
    }
}
// dst[0..8) = src[0..8) * f in T arithmetic (16-byte shared accesses).
template <typename T> __device__ __forceinline__ void scale8(T* dst, const T* src, float f) {
    using T2 = typename Ops<T>::T2;
    uint4 v = *reinterpret_cast<const uint4*>(src);
    T2* e = reinterpret_cast<T2*>(&v);
    const T2 f2 = Ops<T>::pack2(f, f);
#pragma unroll
    for (int i = 0; i < 4; ++i) e[i] = __hmul2(e[i], f2);
    *reinterpret_cast<uint4*>(dst) = v;
}
// The sum of v over a quad (the 4 lanes that hold one accumulator row).
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
// Per row of a block of f32 accumulators (this thread's rows r_lo, r_hi; COLS columns), the dot with
// the same rows of a T tile of pitch PITCH, summed over the quad that holds the row.
template <typename T, int COLS, int PITCH>
__device__ __forceinline__ float2 row_dots(const float (&acc)[COLS / 8][4], const T* tile, int r_lo, int r_hi) {
    using T2 = typename Ops<T>::T2;
    float lo = 0.f, hi = 0.f;
#pragma unroll
    for (int j = 0; j < COLS / 8; ++j) {
        const int col = 8 * j + 2 * (threadIdx.x % 4);
        const float2 vlo = Ops<T>::unpack2(*reinterpret_cast<const T2*>(&tile[r_lo * PITCH + col]));
        const float2 vhi = Ops<T>::unpack2(*reinterpret_cast<const T2*>(&tile[r_hi * PITCH + col]));
        lo += vlo.x * acc[j][0] + vlo.y * acc[j][1];
        hi += vhi.x * acc[j][2] + vhi.y * acc[j][3];
    }
    return make_float2(quad_sum(lo), quad_sum(hi));
}

// acc += (rows o (lo, hi)) state over k = p, for the rows 16 block..: rows a (kQ x kP) tile at shared
// address `rows` whose two rows per thread are scaled by lo, hi; state a (kP x N) tile.
template <typename T, int N>
__device__ __forceinline__ void rows_times_state(float (&acc)[N / 8][4], uint32_t rows, float lo, float hi, uint32_t state,
                                                 int block) {
    constexpr int PX = pitch<kP>(), PN = pitch<N>(), E = sizeof(T);
    const int lane = threadIdx.x & 31;
    const int a_rows = lane & 15, a_cols = (lane >> 4) * 8;
    const int bt_rows = (lane & 7) + ((lane >> 3) & 1) * 8, bt_cols = (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < kP / 16; ++kk) {
        uint32_t af[4];
        ldsm_x4(af, rows + ((16 * block + a_rows) * PX + 16 * kk + a_cols) * E);
        scale_a_rows<T>(af, lo, hi);
#pragma unroll
        for (int q = 0; q < N / 16; ++q) {
            uint32_t bb[4];
            ldsm_x4_trans(bb, state + ((16 * kk + bt_rows) * PN + 16 * q + bt_cols) * E);
            mma_pair<T>(acc[2 * q], acc[2 * q + 1], af, bb);
        }
    }
}

// acc += sum over k-blocks pr >= warp of a[pr] tile[16 pr.., :] (k = step, t >= s): a the A fragments
// of the warp's 16 rows per 16-step block, tile a (kQ x COLS) tile at shared address `tile`.
template <typename T, int COLS, int PITCH>
__device__ __forceinline__ void add_upper_times_tile(float (&acc)[COLS / 8][4], const uint32_t (&a)[kQ / 16][4], uint32_t tile,
                                                     int warp, int bt_rows, int bt_cols) {
    constexpr int E = sizeof(T);
#pragma unroll
    for (int pr = 0; pr < kQ / 16; ++pr) {
        if (pr < warp) continue;
#pragma unroll
        for (int q = 0; q < COLS / 16; ++q) {
            uint32_t bb[4];
            ldsm_x4_trans(bb, tile + ((16 * pr + bt_rows) * PITCH + 16 * q + bt_cols) * E);
            mma_pair<T>(acc[2 * q], acc[2 * q + 1], a[pr], bb);
        }
    }
}

// The first `rows` rows of a shared tile of COLS columns (pitch<COLS>()) to rows dst_pitch elements
// apart at dst, in 16-byte pieces, by warps 1.. of the block.
template <typename T, int COLS>
__device__ __forceinline__ void copy_tile_out(T* dst, int64_t dst_pitch, const T* src, int rows) {
    constexpr int kVec = 16 / sizeof(T), kRowVecs = COLS / kVec;
    for (int i = threadIdx.x - 32; i < rows * kRowVecs; i += kThreads - 32) {
        const int row = i / kRowVecs, v = i % kRowVecs;
        *reinterpret_cast<uint4*>(dst + row * dst_pitch + v * kVec) =
            *reinterpret_cast<const uint4*>(src + row * pitch<COLS>() + v * kVec);
    }
}

}  // namespace ssd_mma
