// Pieces both SSD forward kernels share (ssd_fwd_sync.cuh: mma.sync, any sm_80+; ssd_fwd_wgmma.cuh:
// wgmma, sm_90a): the block's (batch, head) and part, its tile loads, the state entering a part and
// the states written from it. The state is the thread's share of the (kP x N) f32 state in mma
// accumulator layout.
#pragma once
#include <type_traits>

#include "ssd_mma.cuh"

namespace ssd_mma {

// The sequence split (FwdSplit: kernels/params.h): the main kernel scans n_parts parts of
// tiles_per_part tiles; the first pass (LOCAL) scans every part but the last in records_per_part
// pieces (piece_tiles), so that it has blocks enough to fill the GPU, and records each piece's end
// state from zero and its total decay.
__device__ __forceinline__ int64_t n_records(const FwdSplit& s) { return (s.n_parts - 1) * s.records_per_part; }

// The split's records in the workspace: [n_records][batch * heads][kP][N] end states from zero, then
// [n_records][batch * heads] total decays (log2).
struct PartRecords {
    float* states;
    float* decays;
    int64_t per_part;  // batch * heads
    template <int N> static __device__ __forceinline__ PartRecords make(const SsdParams& p, const FwdSplit& split) {
        float* states = static_cast<float*>(p.workspace);
        return {states, states + n_records(split) * p.batch * p.heads * int64_t(kP) * N, p.batch * p.heads};
    }
};

// The (batch, head) and the tiles a forward block scans (grid: batch * heads, then parts, or records
// when LOCAL: `part` is then the record's index).
struct FwdBlock {
    int64_t bh, part, b, h, g, tile_begin, tile_end;
    template <bool LOCAL>
    __device__ __forceinline__ FwdBlock(const SsdParams& p, const FwdSplit& split, std::integral_constant<bool, LOCAL>)
        : bh(blockIdx.x), part(blockIdx.y), b(bh / p.heads), h(bh % p.heads), g(h / (p.heads / p.groups)) {
        const int64_t n_tiles = (p.seqlen + kQ - 1) / kQ;
        if (LOCAL) {
            const int64_t rpp = split.records_per_part;
            piece_tiles(split.tiles_per_part, rpp, part / rpp, part % rpp, n_tiles, tile_begin, tile_end);
        } else {
            piece_tiles(split.tiles_per_part, 1, part, 0, n_tiles, tile_begin, tile_end);
        }
    }
};

// This thread's cp.async chunks of a tile's x, B and C rows (x: also where y goes, same layout) of
// (b, h, g): x, B, C are the forward's, or any arrays of their shapes (the backward's first pass takes
// dy and C for x and B). `issue` copies the tile starting at step t0, rows past the sequence
// zero-filled; x_at / bc_at (row, col) give the byte offset of element (row, col) in the kernel's
// shared layout of x / B, C. WITH_C false (a first pass, which computes no y) leaves C out. Per copy
// only 32-bit checks and one pointer step (64-bit index arithmetic per copy was most of a first
// pass's instructions).
template <typename T, int N> struct TileLoads {
    const TileCopy<kP> xcopy;
    const TileCopy<N> bccopy;
    int64_t seqlen, x_step, bc_step, x_off;
    const T *x_src, *b_src, *c_src;
    __device__ __forceinline__ TileLoads(const SsdParams& p, int64_t b, int64_t h, int64_t g, const void* x,
                                         const void* B, const void* C)
        : seqlen(p.seqlen), x_step(p.heads * kP), bc_step(p.groups * N),
          x_off(((b * p.seqlen + xcopy.row0) * p.heads + h) * kP + xcopy.col) {
        const int64_t bc_off = ((b * p.seqlen + bccopy.row0) * p.groups + g) * N + bccopy.col;
        x_src = static_cast<const T*>(x) + x_off;
        b_src = static_cast<const T*>(B) + bc_off;
        c_src = static_cast<const T*>(C) + bc_off;
    }
    __device__ __forceinline__ TileLoads(const SsdParams& p, const FwdBlock& blk)
        : TileLoads(p, blk.b, blk.h, blk.g, p.x, p.B, p.C) {}
    template <bool WITH_C, typename XAt, typename BCAt>
    __device__ __forceinline__ void issue(int64_t t0, T* x, T* b, T* c, XAt x_at, BCAt bc_at) const {
        const int rows = tile_rows(seqlen, t0);
        const T* xs = x_src + t0 * x_step;
#pragma unroll
        for (int k = 0; k < TileCopy<kP>::kPasses; ++k) {
            const int row = xcopy.row0 + k * TileCopy<kP>::kRowStep;
            cp_async16(reinterpret_cast<unsigned char*>(x) + x_at(row, xcopy.col), row < rows ? xs : x_src, row < rows);
            xs += TileCopy<kP>::kRowStep * x_step;
        }
        const T* bs = b_src + t0 * bc_step;
        const T* cs = c_src + t0 * bc_step;
#pragma unroll
        for (int k = 0; k < TileCopy<N>::kPasses; ++k) {
            const int row = bccopy.row0 + k * TileCopy<N>::kRowStep;
            const uint32_t at = bc_at(row, bccopy.col);
            cp_async16(reinterpret_cast<unsigned char*>(b) + at, row < rows ? bs : b_src, row < rows);
            if (WITH_C) cp_async16(reinterpret_cast<unsigned char*>(c) + at, row < rows ? cs : c_src, row < rows);
            bs += TileCopy<N>::kRowStep * bc_step;
            cs += TileCopy<N>::kRowStep * bc_step;
        }
    }
};

// The state entering a part of (batch, head) bh: the initial state (or zero) carried through the
// `records` records before it. LOCAL (the split's first pass) starts every piece from zero.
template <int N, bool LOCAL>
__device__ __forceinline__ void load_part_state(float (&s)[N / 8][4], const SsdParams& p, const PartRecords& rec,
                                                int64_t bh, int64_t records) {
    const int64_t state_elems = int64_t(kP) * N;
    for_state_pairs<N>(s, [&](float* acc, int row, int col) {
        float2 v = make_float2(0.f, 0.f);
        if (!LOCAL && p.initial_states)
            v = *reinterpret_cast<const float2*>(p.initial_states + bh * state_elems + row * N + col);
        acc[0] = v.x;
        acc[1] = v.y;
    });
    if constexpr (!LOCAL)
        fold_records<N>(s, rec.states + bh * state_elems, rec.decays + bh, rec.per_part, 0, records, 1);
}

// At a part's end: LOCAL records its piece's end state and total decay (log2) as record `part`; the
// last part writes the final states.
template <int N, bool LOCAL>
__device__ __forceinline__ void store_part_state(float (&s)[N / 8][4], const SsdParams& p, const PartRecords& rec,
                                                 int64_t bh, int64_t part, int n_parts, float decay_sum) {
    const int64_t state_elems = int64_t(kP) * N;
    float* dst = LOCAL ? rec.states + (part * rec.per_part + bh) * state_elems
                       : (part == n_parts - 1 && p.final_states ? p.final_states + bh * state_elems : nullptr);
    if (!dst) return;
    for_state_pairs<N>(s, [&](float* acc, int row, int col) {
        *reinterpret_cast<float2*>(dst + row * N + col) = make_float2(acc[0], acc[1]);
    });
    if (LOCAL && threadIdx.x == 0) rec.decays[part * rec.per_part + bh] = decay_sum;
}

// Residual for the backward pass: the state entering each chunk (t0 = the tile's first step), in T.
template <typename T, int N>
__device__ __forceinline__ void store_chunk_state(float (&s)[N / 8][4], const SsdParams& p, int64_t bh, int64_t t0) {
    if (!p.chunk_states || t0 % p.chunk_size != 0) return;
    const int64_t chunk = t0 / p.chunk_size, n_chunks = ssd_chunk_count(p);
    store_state_t<T, N>(s, static_cast<T*>(p.chunk_states) + (bh * kP * n_chunks + chunk) * N, n_chunks * N);
}

}  // namespace ssd_mma
