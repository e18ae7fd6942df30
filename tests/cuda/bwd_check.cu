// Standalone check and timer of the backward kernel (kernels/selective_scan_bwd.cuh), for kernel work
// on a GPU machine without Rust: builds inputs, runs the kernels, compares with a double-precision
// reference of docs/selective_scan_bwd.md, prints the error and the time.
// tests/cuda/run.sh builds and runs it:
//   bwd_check check|time batch dim seqlen dstate groups(0: invariant B/C) layout(bdl|bld)
//                  dtype(f32|bf16) checkpoint_len z D bias softplus h0 dfinal [seqs]
// seqs: packed sequences (batch 1; the _packed kernels): that many, with boundaries that make empty
// and length-1 sequences, fall on part, checkpoint, tile and piece edges and off them, and at
// seqlen, the rest random; the reference runs each sequence's backward alone, and the checkpoints
// at boundaries are NaN (the backward's recompute applies the forward's rule there: any use of the
// state before it shows). Negative: -seqs boundaries of random, invalid values (unsorted, out of
// range): the kernels must stay inside their buffers (run it under compute-sanitizer); nothing is
// compared. SSB_PARTS=n: another sequence split (1 .. checkpoints parts).
#include "../../kernels/selective_scan_bwd.cu"
#include "../../kernels/selective_scan_bwd_packed.cu"
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CK(x)                                                                              \
    do {                                                                                   \
        cudaError_t e = (x);                                                               \
        if (e != cudaSuccess) {                                                            \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

struct Cfg {
    bool check;
    int64_t batch, dim, L, N, groups;
    bool bld, bf;
    int64_t ckl;
    bool z, D, bias, sp, h0, dfin;
    int64_t seqs;  // packed sequences (0: none; negative: that many invalid boundaries)
};

static float round_t(float x, bool bf) {
    if (!bf) return x;
    return __bfloat162float(__float2bfloat16_rn(x));
}

template <typename T> static std::vector<T> to_dev_t(const std::vector<float>& v) {
    std::vector<T> o(v.size());
    for (size_t i = 0; i < v.size(); ++i) o[i] = T(v[i]);
    return o;
}

template <typename T> static void* upload(const std::vector<T>& v) {
    void* p = nullptr;
    CK(cudaMalloc(&p, std::max<size_t>(v.size() * sizeof(T), 16)));
    if (!v.empty()) CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
}
template <typename T> static std::vector<float> download(const void* p, size_t n) {
    std::vector<T> h(n);
    if (n) CK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    std::vector<float> o(n);
    for (size_t i = 0; i < n; ++i) o[i] = float(h[i]);
    return o;
}

template <typename T> int run(const Cfg& cf) {
    const int64_t Bt = cf.batch, D = cf.dim, L = cf.L, N = cf.N, G = cf.groups ? cf.groups : 1;
    const bool varying = cf.groups > 0;
    const bool packed = cf.seqs != 0, garbage = cf.seqs < 0;
    const int64_t n_seqs = packed ? (garbage ? -cf.seqs : cf.seqs) : 0;
    if (packed && Bt != 1) return fprintf(stderr, "packed sequences need batch 1\n"), 2;
    const int64_t state_rows = packed ? n_seqs : Bt;  // rows of the states and their gradients
    std::mt19937 rng(1234);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::uniform_real_distribution<float> ud(0.f, 1.f);
    auto x_index = [&](int64_t b, int64_t d, int64_t l) { return cf.bld ? (b * L + l) * D + d : (b * D + d) * L + l; };
    const int64_t nx = Bt * D * L, nbc = varying ? Bt * G * N * L : D * N;
    std::vector<float> u(nx), delta(nx), z(nx), dout(nx), A(D * N), Bm(nbc), Cm(nbc), Dv(D), bias(D),
        h0(state_rows * D * N), dfin(state_rows * D * N);
    for (auto& x : u) x = round_t(nd(rng), cf.bf);
    for (auto& x : delta) x = round_t(cf.sp ? nd(rng) - 1.f : 0.02f + 0.1f * ud(rng), cf.bf);
    for (auto& x : z) x = round_t(nd(rng), cf.bf);
    for (auto& x : dout) x = round_t(nd(rng), cf.bf);
    for (int64_t i = 0; i < D * N; ++i) A[i] = -(0.5f + float(i % N)) * (0.5f + ud(rng));
    for (auto& x : Bm) x = round_t(nd(rng), cf.bf);
    for (auto& x : Cm) x = round_t(nd(rng), cf.bf);
    for (auto& x : Dv) x = nd(rng);
    for (auto& x : bias) x = cf.sp ? 0.3f * nd(rng) : 0.05f * ud(rng);  // dt > 0 without softplus
    for (auto& x : h0) x = nd(rng);
    for (auto& x : dfin) x = nd(rng);

    const int64_t ncp = (L + cf.ckl - 1) / cf.ckl;
    std::vector<float> ckpt(Bt * D * ncp * N, 0.f);
    const int64_t dpg = D / G;
    int tpc = 2;
    while (tpc * 8 < N) tpc *= 2;
    const int64_t split_target = 2 * 132;  // two blocks per SM, as src/ops/selective_scan/mod.rs
    const int64_t CB = 128 / tpc, group_dim = varying ? dpg : D, tiles = (group_dim + CB - 1) / CB;
    // Sequence split, as src/ops/selective_scan/mod.rs plans it.
    const int64_t blocks = (D / std::max<int64_t>(group_dim, 1)) * tiles * Bt;
    int64_t n_split = 1;
    if (blocks > 0 && 2 * blocks < split_target && ncp >= 2) {
        const int64_t want = std::min<int64_t>(split_target / blocks, ncp);
        const int64_t per = (ncp + want - 1) / want;
        n_split = (ncp + per - 1) / per;
    }
    const char* parts = getenv("SSB_PARTS");  // another split to compare (1 .. checkpoints)
    if (parts && ncp > 0) {
        const int64_t want = std::min<int64_t>(std::max<int64_t>(atoll(parts), 1), ncp);
        const int64_t per = (ncp + want - 1) / want;
        n_split = (ncp + per - 1) / per;
    }
    const int64_t part_len = (ncp + n_split - 1) / n_split * cf.ckl;

    // Packed: the boundaries (cu_seqlens), made once the split's parts are known.
    std::vector<int32_t> cu;
    if (packed) {
        if (garbage) {
            cu.resize(n_seqs + 1);
            for (auto& x : cu) x = int32_t(ud(rng) * float(L + 101)) - 50;
        } else {
            // First the positions that matter most, in order, then random ones: an empty first
            // sequence, length-1 ones, an empty last one; part edges (an empty sequence at the
            // first), checkpoint, tile and piece edges, and steps off them (adjacent boundaries).
            std::vector<int64_t> want = {0, 1, L, L - 1};
            for (int64_t k = 1; k < n_split; ++k) {
                want.push_back(k * part_len);
                if (k == 1) want.push_back(k * part_len), want.push_back(k * part_len + 1);
            }
            for (int64_t x : {cf.ckl, 2 * cf.ckl + 5, int64_t(32), int64_t(77), int64_t(33), int64_t(45), int64_t(8),
                              int64_t(100), int64_t(101), int64_t(102), 3 * cf.ckl - 1})
                want.push_back(x);
            std::vector<int64_t> inner;
            for (int64_t x : want)
                if (int64_t(inner.size()) < n_seqs - 1 && x >= 0 && x <= L) inner.push_back(x);
            while (int64_t(inner.size()) < n_seqs - 1) inner.push_back(std::min<int64_t>(L, int64_t(ud(rng) * float(L + 1))));
            std::sort(inner.begin(), inner.end());
            cu.push_back(0);
            for (int64_t x : inner) cu.push_back(int32_t(x));
            cu.push_back(int32_t(L));
            int64_t empty = 0, single = 0;
            for (int64_t s = 0; s < n_seqs; ++s) empty += cu[s + 1] == cu[s], single += cu[s + 1] - cu[s] == 1;
            printf("  packed: %ld sequences (%ld empty, %ld of length 1), %ld parts of %ld steps\n", (long)n_seqs,
                   (long)empty, (long)single, (long)n_split, (long)part_len);
        }
    }
    // Reference, double: forward with history, then the backward per channel (packed: per sequence).
    std::vector<double> gu(nx), gdelta(nx), gz(nx), gA(D * N, 0), gB(nbc, 0), gC(nbc, 0), gD(D, 0), gbias(D, 0),
        gh0(state_rows * D * N);
    auto bcv = [&](const std::vector<float>& M, int64_t b, int64_t d, int64_t n, int64_t l) -> double {
        if (!varying) return M[d * N + n];
        const int64_t g = d / dpg;
        return M[cf.bld ? ((b * L + l) * G + g) * N + n : ((b * G + g) * N + n) * L + l];
    };
    auto bci = [&](int64_t b, int64_t d, int64_t n, int64_t l) -> int64_t {
        if (!varying) return d * N + n;
        const int64_t g = d / dpg;
        return cf.bld ? ((b * L + l) * G + g) * N + n : ((b * G + g) * N + n) * L + l;
    };
    if (cf.check && !garbage) {
        std::vector<double> hs((L + 1) * N), dtv(L), av(L * N), yv(L);
        // Steps [lb, le) of channel (b, d) alone, from state `state0` (null: zeros) with the cotangent
        // `g_end` (null: zeros) of the state after them; gh_out gets the gradient of state0. Records
        // the checkpoints inside (at lb, where a packed sequence starts: NaN, as the backward must
        // apply the forward's rule there rather than use the state before it).
        auto ref_span = [&](int64_t b, int64_t d, int64_t lb, int64_t le, const float* state0, const float* g_end,
                            double* gh_out) {
            for (int64_t n = 0; n < N; ++n) hs[lb * N + n] = state0 ? state0[n] : 0.0;
            for (int64_t l = lb; l < le; ++l) {
                const int64_t xi = x_index(b, d, l);
                double x = double(delta[xi]) + (cf.bias ? bias[d] : 0.0);
                double dt = cf.sp ? (x > 20 ? x : std::log1p(std::exp(x))) : x;
                dtv[l] = dt;
                double y = 0;
                if (l % cf.ckl == 0)
                    for (int64_t n = 0; n < N; ++n)
                        ckpt[((b * D + d) * ncp + l / cf.ckl) * N + n] = packed && l == lb ? NAN : float(hs[l * N + n]);
                for (int64_t n = 0; n < N; ++n) {
                    double a = std::exp(dt * A[d * N + n]);
                    av[l * N + n] = a;
                    hs[(l + 1) * N + n] = a * hs[l * N + n] + dt * bcv(Bm, b, d, n, l) * u[xi];
                    y += bcv(Cm, b, d, n, l) * hs[(l + 1) * N + n];
                }
                yv[l] = y + (cf.D ? Dv[d] * u[xi] : 0.0);
            }
            std::vector<double> g(N);
            for (int64_t n = 0; n < N; ++n) g[n] = g_end ? g_end[n] : 0.0;
            for (int64_t l = le - 1; l >= lb; --l) {
                const int64_t xi = x_index(b, d, l);
                double dy = dout[xi];
                if (cf.z) {
                    double zz = z[xi], s = 1 / (1 + std::exp(-zz));
                    gz[xi] = dout[xi] * yv[l] * s * (1 + zz * (1 - s));
                    dy = dout[xi] * zz * s;
                }
                double ddt = 0, du = cf.D ? Dv[d] * dy : 0.0;
                if (cf.D) gD[d] += dy * u[xi];
                for (int64_t n = 0; n < N; ++n) {
                    g[n] += bcv(Cm, b, d, n, l) * dy;
                    gC[bci(b, d, n, l)] += dy * hs[(l + 1) * N + n];
                    gB[bci(b, d, n, l)] += g[n] * dtv[l] * u[xi];
                    du += g[n] * dtv[l] * bcv(Bm, b, d, n, l);
                    double w = g[n] * av[l * N + n] * hs[l * N + n];
                    ddt += g[n] * bcv(Bm, b, d, n, l) * u[xi] + A[d * N + n] * w;
                    gA[d * N + n] += w * dtv[l];
                    g[n] *= av[l * N + n];
                }
                double x = double(delta[xi]) + (cf.bias ? bias[d] : 0.0);
                double dd = cf.sp ? ddt / (1 + std::exp(-x)) : ddt;
                gu[xi] = du;
                gdelta[xi] = dd;
                gbias[d] += dd;
            }
            for (int64_t n = 0; n < N; ++n) gh_out[n] = g[n];
        };
        for (int64_t b = 0; b < Bt; ++b)
            for (int64_t d = 0; d < D; ++d) {
                if (!packed) {
                    const int64_t row = (b * D + d) * N;
                    ref_span(b, d, 0, L, cf.h0 ? &h0[row] : nullptr, cf.dfin ? &dfin[row] : nullptr, &gh0[row]);
                    continue;
                }
                for (int64_t sq = 0; sq < n_seqs; ++sq) {
                    const int64_t row = (sq * D + d) * N;
                    ref_span(b, d, cu[sq], cu[sq + 1], cf.h0 ? &h0[row] : nullptr, cf.dfin ? &dfin[row] : nullptr, &gh0[row]);
                }
            }
    }

    // Device buffers.
    std::vector<T> tu = to_dev_t<T>(u), tdelta = to_dev_t<T>(delta), tz = to_dev_t<T>(z), tdout = to_dev_t<T>(dout),
                   tB = to_dev_t<T>(Bm), tC = to_dev_t<T>(Cm);
    SelectiveScanBwdParams q;
    memset(&q, 0, sizeof(q));
    SelectiveScanFwdParams& p = q.fwd;
    p.u = upload(tu), p.delta = upload(tdelta), p.A = (float*)upload(A), p.B = upload(tB), p.C = upload(tC);
    p.D = cf.D ? (float*)upload(Dv) : nullptr;
    p.z = cf.z ? upload(tz) : nullptr;
    p.delta_bias = cf.bias ? (float*)upload(bias) : nullptr;
    // Unpacked, h0 enters through checkpoint 0; packed, the backward reads it at every sequence start.
    p.initial_state = packed && cf.h0 ? (float*)upload(h0) : nullptr;
    p.batch = Bt, p.dim = D, p.seqlen = L, p.dstate = N;
    p.dim_per_group = varying ? dpg : 1;
    if (cf.bld) p.x_stride_batch = L * D, p.x_stride_dim = 1, p.x_stride_seq = D;
    else p.x_stride_batch = D * L, p.x_stride_dim = L, p.x_stride_seq = 1;
    if (!varying) p.bc_stride_batch = 0, p.bc_stride_group = N, p.bc_stride_state = 1, p.bc_stride_seq = 0;
    else if (cf.bld) p.bc_stride_batch = L * G * N, p.bc_stride_group = N, p.bc_stride_state = 1, p.bc_stride_seq = G * N;
    else p.bc_stride_batch = G * N * L, p.bc_stride_group = N * L, p.bc_stride_state = L, p.bc_stride_seq = 1;
    p.delta_softplus = cf.sp;
    p.checkpoints = (float*)upload(ckpt);
    p.checkpoint_len = cf.ckl;
    q.dout = upload(tdout);
    q.dfinal_state = cf.dfin ? (float*)upload(dfin) : nullptr;
    std::vector<float> zeros_x(nx, 0.f);
    q.du = upload(to_dev_t<T>(zeros_x)), q.ddelta = upload(to_dev_t<T>(zeros_x));
    q.dz = cf.z ? upload(to_dev_t<T>(zeros_x)) : nullptr;
    q.dA = (float*)upload(std::vector<float>(D * N, 0.f));
    q.dB = upload(to_dev_t<T>(std::vector<float>(nbc, 0.f)));
    q.dC = upload(to_dev_t<T>(std::vector<float>(nbc, 0.f)));
    q.dD = cf.D ? (float*)upload(std::vector<float>(D, 0.f)) : nullptr;
    q.ddelta_bias = cf.bias ? (float*)upload(std::vector<float>(D, 0.f)) : nullptr;
    // Packed: NaN first, so that a row the kernel does not write fails.
    q.dinitial_state = cf.h0 ? (float*)upload(std::vector<float>(state_rows * D * N, packed ? NAN : 0.f)) : nullptr;
    if (packed) p.cu_seqlens = (const int32_t*)upload(cu), p.num_seqs = n_seqs;

    const int64_t bc_part = varying ? Bt * (D / group_dim) * tiles * L * N : n_split * Bt * D * N;
    const int64_t ws_floats = 2 * bc_part + n_split * (Bt * D * N + 2 * Bt * D) + (n_split - 1) * Bt * D * (N + 1);
    p.workspace = (float*)upload(std::vector<float>(std::max<int64_t>(ws_floats, 1), 0.f));
    p.chunk_len = part_len, p.n_chunks = n_split;
    const int64_t tiles_per_chunk = cf.ckl / 32;
    int64_t shared_floats = 0;
#define SHARED(TPCV) shared_floats = BwdShape<TPCV>::kTileStart + tiles_per_chunk * BwdShape<TPCV>::kTileStartFloats;
    if (tpc == 2) { SHARED(2) } else if (tpc == 4) { SHARED(4) } else if (tpc == 8) { SHARED(8) }
    else if (tpc == 16) { SHARED(16) } else { SHARED(32) }
    if (packed) shared_floats += kBwdSeqTableBytes / 4;  // the packed kernels' boundary table
    int64_t raw_bytes = 0;
#define RAW(TT, TPCV) raw_bytes = varying ? RawTile<TT, TT, TPCV, true>::kBytes : RawTile<TT, TT, TPCV, false>::kBytes;
#define RAW_ALL(TT)                                                                                        \
    if (tpc == 2) { RAW(TT, 2) } else if (tpc == 4) { RAW(TT, 4) } else if (tpc == 8) { RAW(TT, 8) }        \
    else if (tpc == 16) { RAW(TT, 16) } else { RAW(TT, 32) }
    if (cf.bf) { RAW_ALL(bf16) } else { RAW_ALL(f32) }
    // The library's rule (cuda_bwd.rs): room for the next tile's raw copy when it costs no block per
    // SM. SSB_NO_COPY_AHEAD=1 leaves it out (to time both in one run).
    int sm_shared = 0, reserved = 0;
    CK(cudaDeviceGetAttribute(&sm_shared, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
    CK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, 0));
    auto blocks_per_sm = [&](int64_t bytes) { return std::min<int64_t>(2, sm_shared / (bytes + reserved)); };
    const bool no_copy_ahead = getenv("SSB_NO_COPY_AHEAD") && atoi(getenv("SSB_NO_COPY_AHEAD"));
    if (!no_copy_ahead && blocks_per_sm(shared_floats * 4 + raw_bytes) >= blocks_per_sm(shared_floats * 4)) shared_floats += raw_bytes / 4;
    const size_t shared = shared_floats * 4;

    void (*kern)(const SelectiveScanBwdParams) = nullptr;
    void (*local)(const SelectiveScanBwdParams) = nullptr;
#define PICK_PASS(TT, TPCV, MAIN, LOCAL)                                                                    \
    {                                                                                                        \
        kern = varying ? selective_scan_bwd_##MAIN##_##TT##_##TT##_tpc##TPCV##_varying                       \
                       : selective_scan_bwd_##MAIN##_##TT##_##TT##_tpc##TPCV##_invariant;                    \
        local = varying ? selective_scan_bwd_##LOCAL##_##TT##_##TT##_tpc##TPCV##_varying                     \
                        : selective_scan_bwd_##LOCAL##_##TT##_##TT##_tpc##TPCV##_invariant;                  \
    }
#define PICK(TT, TPCV)                                                                                      \
    {                                                                                                        \
        if (packed) PICK_PASS(TT, TPCV, tiled_packed, tiled_local_packed)                                   \
        else PICK_PASS(TT, TPCV, tiled, tiled_local)                                                         \
    }
#define PICK_ALL(TT)                                                                                         \
    if (tpc == 2) PICK(TT, 2) else if (tpc == 4) PICK(TT, 4) else if (tpc == 8) PICK(TT, 8)                   \
    else if (tpc == 16) PICK(TT, 16) else PICK(TT, 32)
    if (cf.bf) { PICK_ALL(bf16) } else { PICK_ALL(f32) }
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared)));
    CK(cudaFuncSetAttribute(local, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared)));
    auto red_bc = cf.bf ? selective_scan_bwd_reduce_bc_bf16 : selective_scan_bwd_reduce_bc_f32;
    auto red_p = cf.bf ? selective_scan_bwd_reduce_params_bf16 : selective_scan_bwd_reduce_params_f32;
    dim3 grid((D / std::max<int64_t>(group_dim, 1)) * tiles, Bt, n_split);
    auto launch = [&]() {
        if (Bt > 0 && D > 0 && n_split > 1) local<<<dim3(grid.x, grid.y, n_split - 1), 128, shared>>>(q);
        if (Bt > 0 && D > 0) kern<<<grid, 128, shared>>>(q);
        SelectiveScanBwdReduceParams r{q, tiles, bc_part, G, varying, 0};
        if (varying && Bt * G * L * N > 0) red_bc<<<(unsigned)std::min<int64_t>((Bt * G * L * N + 255) / 256, 65535), 256>>>(r);
        if (D > 0) red_p<<<(unsigned)std::min<int64_t>((D * std::max<int64_t>(N, 1) + 255) / 256, 65535), 256>>>(r);
    };
    launch();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    if (garbage && cf.check) {
        printf("ran with invalid boundaries (nothing compared)\n");
        return 0;
    }

    if (cf.check) {
        double worst = 0;
        auto cmp = [&](const char* name, const std::vector<float>& got, const std::vector<double>& want) {
            double num = 0, den = 0, maxe = 0;
            int64_t bad = 0;  // not finite (a NaN-filled row never written fails here)
            for (size_t i = 0; i < want.size(); ++i) {
                if (!std::isfinite(got[i])) {
                    ++bad;
                    continue;
                }
                double e = got[i] - want[i];
                num += e * e, den += want[i] * want[i];
                maxe = std::max(maxe, std::fabs(e));
            }
            double rel = bad ? INFINITY : std::sqrt(num / std::max(den, 1e-30));
            printf("  %-14s rel_l2 %.2e  max_abs %.2e%s\n", name, rel, maxe, bad ? "  (not finite: FAIL)" : "");
            if (bad) printf("  %-14s %ld values not finite\n", name, (long)bad);
            worst = std::max(worst, rel);
        };
        cmp("du", download<T>(q.du, nx), gu);
        cmp("ddelta", download<T>(q.ddelta, nx), gdelta);
        if (cf.z) cmp("dz", download<T>(q.dz, nx), gz);
        cmp("dA", download<float>(q.dA, D * N), gA);
        cmp("dB", download<T>(q.dB, nbc), gB);
        cmp("dC", download<T>(q.dC, nbc), gC);
        if (cf.D) cmp("dD", download<float>(q.dD, D), gD);
        if (cf.bias) cmp("ddelta_bias", download<float>(q.ddelta_bias, D), gbias);
        if (cf.h0) cmp("dinitial", download<float>(q.dinitial_state, state_rows * D * N), gh0);
        const double tol = cf.bf ? 2e-2 : 1e-4;
        printf("%s worst rel_l2 %.2e (tol %.0e)\n", worst <= tol ? "PASS" : "FAIL", worst, tol);
        return worst <= tol ? 0 : 1;
    }
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; ++i) launch();
    const int reps = 20;
    CK(cudaEventRecord(e0));
    for (int i = 0; i < reps; ++i) launch();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    printf("time %.1f us  (%ld x %ld x %ld x %ld, tpc %d, shared %zu B, grid %u x %u x %u)\n", 1000 * ms / reps, (long)Bt,
           (long)D, (long)L, (long)N, tpc, shared, grid.x, grid.y, grid.z);
    return 0;
}

int main(int argc, char** argv) {
    if (argc < 16) {
        fprintf(stderr, "usage: see the header of tests/cuda/bwd_check.cu\n");
        return 2;
    }
    Cfg c;
    c.check = std::string(argv[1]) == "check";
    c.batch = atol(argv[2]), c.dim = atol(argv[3]), c.L = atol(argv[4]), c.N = atol(argv[5]), c.groups = atol(argv[6]);
    c.bld = std::string(argv[7]) == "bld";
    c.bf = std::string(argv[8]) == "bf16";
    c.ckl = atol(argv[9]);
    c.z = atoi(argv[10]), c.D = atoi(argv[11]), c.bias = atoi(argv[12]), c.sp = atoi(argv[13]), c.h0 = atoi(argv[14]);
    c.dfin = atoi(argv[15]);
    c.seqs = argc > 16 ? atoll(argv[16]) : 0;
    return c.bf ? run<bf16>(c) : run<float>(c);
}
