// Standalone check and timing of the tensor-core SSD backward (kernels/ssd_bwd.cu), for a GPU machine
// without Rust (tests/cuda/run.sh builds and runs it).
//   ssd_bwd_check check|time batch seqlen heads groups dstate dtype chunk D bias softplus h0 dfinal clamp
// D: 0 none, 1 per head, 2 per channel. `check` compares every gradient with a double-precision
// reverse recurrence (chunk states come from the reference forward); `time` times the kernels.
// dB and dC through the head sums, or with SSD_BWD_PARTIALS=1 through the per-head partials.
#include "../../kernels/ssd_bwd.cu"
#include "ssd_split.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <random>
#include <vector>

#define CK(x)                                                                               \
    do {                                                                                    \
        cudaError_t e = (x);                                                                \
        if (e != cudaSuccess) {                                                             \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(2);                                                                        \
        }                                                                                   \
    } while (0)

static bool g_bf16;
static float round_t(float v) { return g_bf16 ? __bfloat162float(__float2bfloat16(v)) : __half2float(__float2half(v)); }
static float* dev_f32(const std::vector<float>& v) {
    float* d;
    CK(cudaMalloc(&d, std::max<size_t>(v.size(), 1) * 4));
    CK(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    return d;
}
static void* dev_elems(const std::vector<float>& v) {
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
        if (g_bf16) {
            bf16 x = __float2bfloat16(v[i]);
            memcpy(&h[i], &x, 2);
        } else {
            f16 x = __float2half(v[i]);
            memcpy(&h[i], &x, 2);
        }
    }
    void* d;
    CK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * 2));
    CK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    return d;
}
static std::vector<float> host_t(const void* d, size_t n) {
    std::vector<uint16_t> h(n);
    CK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) {
        if (g_bf16) {
            uint32_t u = uint32_t(h[i]) << 16;
            memcpy(&v[i], &u, 4);
        } else {
            f16 x;
            memcpy(&x, &h[i], 2);
            v[i] = __half2float(x);
        }
    }
    return v;
}
static std::vector<float> host_f32(const float* d, size_t n) {
    std::vector<float> v(n);
    CK(cudaMemcpy(v.data(), d, n * 4, cudaMemcpyDeviceToHost));
    return v;
}

int main(int argc, char** argv) {
    if (argc != 15) {
        fprintf(stderr, "usage: %s check|time batch seqlen heads groups dstate bf16|f16 chunk D bias softplus h0 dfinal clamp\n", argv[0]);
        return 2;
    }
    const bool timing = !strcmp(argv[1], "time");
    const int64_t B = atoll(argv[2]), L = atoll(argv[3]), H = atoll(argv[4]), G = atoll(argv[5]), N = atoll(argv[6]);
    g_bf16 = !strcmp(argv[7], "bf16");
    const int64_t chunk = atoll(argv[8]);
    const int d_mode = atoi(argv[9]);
    const bool has_bias = atoi(argv[10]), sp = atoi(argv[11]), has_h0 = atoi(argv[12]), has_dfin = atoi(argv[13]),
               clamp = atoi(argv[14]);
    const int64_t P = 64, NC = (L + chunk - 1) / chunk, HPG = H / G;
    printf("%s b=%lld l=%lld h=%lld g=%lld n=%lld %s chunk=%lld D=%d bias=%d sp=%d h0=%d dfin=%d clamp=%d\n", argv[1],
           (long long)B, (long long)L, (long long)H, (long long)G, (long long)N, argv[7], (long long)chunk, d_mode, has_bias,
           sp, has_h0, has_dfin, clamp);
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    auto fill = [&](size_t n, float scale, float shift, bool round) {
        std::vector<float> v(n);
        for (auto& e : v) e = shift + scale * uni(rng), e = round ? round_t(e) : e;
        return v;
    };
    std::vector<float> x = fill(B * L * H * P, 1.f, 0.f, true), dt = fill(B * L * H, 1.f, sp ? -2.f : 0.15f, true);
    if (!sp)
        for (auto& e : dt) e = round_t(fabsf(e));
    std::vector<float> Bv = fill(B * L * G * N, 1.f, 0.f, true), Cv = fill(B * L * G * N, 1.f, 0.f, true);
    std::vector<float> dy = fill(B * L * H * P, 1.f, 0.f, true);
    std::vector<float> A(H), Dv(d_mode == 2 ? H * P : H), bias(H);
    for (auto& e : A) e = -expf(1.5f * uni(rng));
    for (auto& e : Dv) e = uni(rng);
    for (auto& e : bias) e = 0.5f * uni(rng);
    std::vector<float> h0 = fill(B * H * P * N, 1.f, 0.f, false), dfin = fill(B * H * P * N, 1.f, 0.f, false);
    const float dt_min = clamp ? 0.02f : 0.f, dt_max = clamp ? 0.5f : INFINITY;

    // Reference: forward (state history) and the reverse recurrence, per (b, h), in double.
    std::vector<double> rdx(x.size()), rddt(dt.size()), rdA(H), rdB(Bv.size()), rdC(Cv.size()), rdD(Dv.size()),
        rdbias(H), rdh0(h0.size());
    std::vector<float> chunk_states(B * H * P * NC * N);
    const bool check = !timing;
    for (int64_t bh = 0; check && bh < B * H; ++bh) {
        const int64_t b = bh / H, h = bh % H, g = h / HPG;
        std::vector<double> hist((L + 1) * P * N), dtv(L);
        std::vector<char> pass(L);
        std::vector<double> sig(L);
        for (int64_t i = 0; i < P * N; ++i) hist[i] = has_h0 ? h0[bh * P * N + i] : 0.0;
        for (int64_t t = 0; t < L; ++t) {
            double v = dt[(b * L + t) * H + h] + (has_bias ? bias[h] : 0.0);
            sig[t] = sp ? 1.0 / (1.0 + exp(-v)) : 1.0;
            if (sp) v = v > 20 ? v : log1p(exp(v));
            pass[t] = v >= dt_min && v <= dt_max;
            dtv[t] = std::min<double>(std::max<double>(v, dt_min), dt_max);
            const double dec = exp(dtv[t] * A[h]);
            const double* prev = &hist[t * P * N];
            double* cur = &hist[(t + 1) * P * N];
            for (int64_t pp = 0; pp < P; ++pp)
                for (int64_t n = 0; n < N; ++n)
                    cur[pp * N + n] = dec * prev[pp * N + n] +
                                      dtv[t] * x[((b * L + t) * H + h) * P + pp] * Bv[((b * L + t) * G + g) * N + n];
        }
        for (int64_t c = 0; c < NC; ++c)
            for (int64_t pp = 0; pp < P; ++pp)
                for (int64_t n = 0; n < N; ++n)
                    chunk_states[((bh * P + pp) * NC + c) * N + n] = float(hist[c * chunk * P * N + pp * N + n]);
        std::vector<double> Gs(P * N);
        for (int64_t i = 0; i < P * N; ++i) Gs[i] = has_dfin ? dfin[bh * P * N + i] : 0.0;
        for (int64_t t = L - 1; t >= 0; --t) {
            const float* xt = &x[((b * L + t) * H + h) * P];
            const float* dyt = &dy[((b * L + t) * H + h) * P];
            const float* Bt = &Bv[((b * L + t) * G + g) * N];
            const float* Ct = &Cv[((b * L + t) * G + g) * N];
            const double* St = &hist[(t + 1) * P * N];
            const double* Sp = &hist[t * P * N];
            for (int64_t pp = 0; pp < P; ++pp)
                for (int64_t n = 0; n < N; ++n) {
                    Gs[pp * N + n] += double(dyt[pp]) * Ct[n];
                    rdC[((b * L + t) * G + g) * N + n] += double(dyt[pp]) * St[pp * N + n];
                }
            const double dec = exp(dtv[t] * A[h]);
            double ddt = 0, dAterm = 0;
            for (int64_t pp = 0; pp < P; ++pp) {
                double acc = 0;
                for (int64_t n = 0; n < N; ++n) {
                    acc += Gs[pp * N + n] * Bt[n];
                    rdB[((b * L + t) * G + g) * N + n] += dtv[t] * Gs[pp * N + n] * xt[pp];
                    ddt += Gs[pp * N + n] * (double(xt[pp]) * Bt[n] + A[h] * dec * Sp[pp * N + n]);
                    dAterm += Gs[pp * N + n] * dec * Sp[pp * N + n];
                }
                const double dcoef = d_mode == 0 ? 0.0 : Dv[d_mode == 1 ? h : h * P + pp];
                rdx[((b * L + t) * H + h) * P + pp] = dtv[t] * acc + dcoef * dyt[pp];
                if (d_mode) rdD[d_mode == 1 ? h : h * P + pp] += double(dyt[pp]) * xt[pp];
            }
            rdA[h] += dtv[t] * dAterm;
            const double graw = pass[t] ? ddt * sig[t] : 0.0;
            rddt[(b * L + t) * H + h] = graw;
            rdbias[h] += graw;
            for (int64_t i = 0; i < P * N; ++i) Gs[i] *= dec;
        }
        for (int64_t i = 0; i < P * N; ++i) rdh0[bh * P * N + i] = Gs[i];
    }

    // Device call.
    ssd_mma::SsdBwdMmaParams a = {};
    SsdParams& p = a.q.fwd;
    p.x = dev_elems(x), p.dt = dev_elems(dt), p.A = dev_f32(A), p.B = dev_elems(Bv), p.C = dev_elems(Cv);
    p.D = d_mode ? dev_f32(Dv) : nullptr;
    p.dt_bias = has_bias ? dev_f32(bias) : nullptr;
    p.initial_states = has_h0 ? dev_f32(h0) : nullptr;
    p.chunk_states = dev_elems(chunk_states);  // in T, as the forward saves them on this path
    p.batch = B, p.seqlen = L, p.heads = H, p.headdim = P, p.dstate = N, p.groups = G, p.chunk_size = chunk;
    p.dt_min = dt_min, p.dt_max = dt_max, p.dt_softplus = sp, p.D_per_channel = d_mode == 2;
    a.q.dy = dev_elems(dy);
    a.q.dfinal_states = has_dfin ? dev_f32(dfin) : nullptr;
    void *dx_d, *ddt_d, *dB_d, *dC_d;
    CK(cudaMalloc(&dx_d, x.size() * 2 + 2));
    CK(cudaMalloc(&ddt_d, dt.size() * 2 + 2));
    CK(cudaMalloc(&dB_d, Bv.size() * 2 + 2));
    CK(cudaMalloc(&dC_d, Cv.size() * 2 + 2));
    float *dA_d, *dD_d, *dbias_d, *dh0_d;
    CK(cudaMalloc(&dA_d, H * 4));
    CK(cudaMalloc(&dD_d, Dv.size() * 4));
    CK(cudaMalloc(&dbias_d, H * 4));
    CK(cudaMalloc(&dh0_d, h0.size() * 4 + 4));
    a.q.dx = dx_d, a.q.ddt = ddt_d, a.q.dB = dB_d, a.q.dC = dC_d, a.q.dA = dA_d;
    a.q.dD = d_mode ? dD_d : nullptr;
    a.q.ddt_bias = has_bias ? dbias_d : nullptr;
    a.q.dinitial_states = dh0_d;
    const int64_t tpc = chunk / 64;
    // The launcher's split (mirrored in src/ops/ssd/plan.rs): parts of whole chunks, as many as one wave holds.
    int64_t parts = std::max<int64_t>(1, std::min<int64_t>(264 / std::max<int64_t>(B * H, 1), NC));
    if (getenv("SSD_BWD_PARTS")) parts = atoll(getenv("SSD_BWD_PARTS"));
    a.chunks_per_part = std::max<int64_t>(1, (NC + parts - 1) / parts);
    a.n_parts = std::max<int64_t>(1, (NC + a.chunks_per_part - 1) / a.chunks_per_part);
    a.records_per_part = records_per_part(B * H, a.n_parts, a.chunks_per_part * tpc, "SSD_BWD_RECORDS");
    printf("parts %lld of %lld chunks, first pass in %lld pieces a part\n", (long long)a.n_parts,
           (long long)a.chunks_per_part, (long long)a.records_per_part);
    CK(cudaMalloc(&a.da_part, a.n_parts * B * H * 4 + 4));
    CK(cudaMalloc(&a.dbias_part, a.n_parts * B * H * 4 + 4));
    CK(cudaMalloc(&a.dd_part, a.n_parts * B * H * P * 4 + 4));
    CK(cudaMalloc(&a.scratch, a.n_parts * B * H * std::max<int64_t>(tpc - 3, 0) * P * N * 2 + 16));
    CK(cudaMalloc(&a.records, (a.n_parts - 1) * a.records_per_part * B * H * (P * N + 1) * 4 + 4));
    const int64_t pairs = tpc * (tpc + 1) / 2;
    CK(cudaMalloc(&a.s_chunk, B * H * NC * P * N * 2 + 16));
    CK(cudaMalloc(&a.ds_chunk, B * H * NC * P * N * 2 + 16));
    CK(cudaMalloc(&a.scal, B * H * NC * chunk * 8 + 16));
    // head_msum's head ranges per group (plan.rs: at most 2, at most the group's heads; SSD_MSUM_SPLIT overrides).
    a.msum_split = getenv("SSD_MSUM_SPLIT") ? atoll(getenv("SSD_MSUM_SPLIT")) : std::min<int64_t>(2, H / G);
    // SSD_BWD_PARTIALS=1: the per-head path (dB, dC partials per head, then reduce_bc).
    const bool partials = getenv("SSD_BWD_PARTIALS") && atoi(getenv("SSD_BWD_PARTIALS"));
    if (partials) {
        CK(cudaMalloc(&a.db_part, B * L * H * N * 2 + 16));
        CK(cudaMalloc(&a.dc_part, B * L * H * N * 2 + 16));
    }
    CK(cudaMalloc(&a.msum, B * NC * G * a.msum_split * pairs * 64 * 64 * 4 + 16));

    // stages: 1 the main kernels, 2 the head sums and the reductions after them.
    auto launch = [&](int stages = 3) {
        const int smem = int(N == 64 ? sizeof(ssd_mma::BwdSmem<bf16, 64>) : sizeof(ssd_mma::BwdSmem<bf16, 128>));
        auto k = partials ? (g_bf16 ? (N == 64 ? ssd_bwd_mma_partials_bf16_n64 : ssd_bwd_mma_partials_bf16_n128)
                                    : (N == 64 ? ssd_bwd_mma_partials_f16_n64 : ssd_bwd_mma_partials_f16_n128))
                          : (g_bf16 ? (N == 64 ? ssd_bwd_mma_bf16_n64 : ssd_bwd_mma_bf16_n128)
                                    : (N == 64 ? ssd_bwd_mma_f16_n64 : ssd_bwd_mma_f16_n128));
        auto kl = g_bf16 ? (N == 64 ? ssd_bwd_mma_local_bf16_n64 : ssd_bwd_mma_local_bf16_n128)
                         : (N == 64 ? ssd_bwd_mma_local_f16_n64 : ssd_bwd_mma_local_f16_n128);
        CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        CK(cudaFuncSetAttribute(kl, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        if ((stages & 1) && B * H > 0 && a.n_parts > 1) kl<<<dim3(unsigned(B * H), unsigned(a.n_parts - 1) * unsigned(a.records_per_part)), ssd_mma::kThreads, smem>>>(a);
        const unsigned units = unsigned(B * NC * G);
        // As the library launches them (SSD_BWD_PDL=0: all the ordinary way): on the head-sum path
        // chunk_scalars before the main kernel; it and the kernels after the main one launched
        // programmatically (src/cuda/mod.rs, Start::Overlapping).
        const bool use_pdl = !getenv("SSD_BWD_PDL") || atoi(getenv("SSD_BWD_PDL"));
        auto launch_pdl = [&](auto kernel, dim3 grid, unsigned block, int smem_bytes, bool pdl_ok = true) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = grid;
            cfg.blockDim = dim3(block);
            cfg.dynamicSmemBytes = size_t(smem_bytes);
            cudaLaunchAttribute pdl[1];
            pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            pdl[0].val.programmaticStreamSerializationAllowed = 1;
            cfg.attrs = pdl;
            cfg.numAttrs = use_pdl && pdl_ok ? 1 : 0;
            CK(cudaLaunchKernelEx(&cfg, kernel, a));
        };
        if (!partials && (stages & 2) && B * H * NC > 0)
            launch_pdl(g_bf16 ? ssd_bwd_chunk_scalars_bf16 : ssd_bwd_chunk_scalars_f16, dim3(unsigned((B * H * NC + 7) / 8)), 256, 0);
        if ((stages & 1) && B * H > 0) k<<<dim3(unsigned(B * H), unsigned(a.n_parts)), ssd_mma::kThreads, smem>>>(a);
        if (!(stages & 2)) return;
        if (partials) {
            const int64_t items = B * L * G * N / 8;  // as the launcher: 256 threads, at most 4096 blocks
            const unsigned blocks = unsigned(std::max<int64_t>(1, std::min<int64_t>((items + 255) / 256, 4096)));
            (g_bf16 ? ssd_bwd_reduce_bc_bf16 : ssd_bwd_reduce_bc_f16)<<<blocks, 256>>>(a);
        } else if (B * H * NC > 0) {
            auto msum = g_bf16 ? ssd_bwd_head_msum_bf16 : ssd_bwd_head_msum_f16;
            const int msum_smem = int(ssd_mma::msum_shared_bytes(chunk));
            CK(cudaFuncSetAttribute(msum, cudaFuncAttributeMaxDynamicSharedMemorySize, msum_smem));
            // (Only right after the main kernel: it reads chunk_scalars' output.)
            launch_pdl(msum, dim3(unsigned(units * a.msum_split)), 32 * ssd_mma::kMsumWarps, msum_smem, stages & 1);
            const int bc_smem = int(N == 64 ? ssd_mma::bc_shared_bytes<64>(chunk) : ssd_mma::bc_shared_bytes<128>(chunk));
            auto bc = g_bf16 ? (N == 64 ? ssd_bwd_bc_sums_bf16_n64 : ssd_bwd_bc_sums_bf16_n128)
                             : (N == 64 ? ssd_bwd_bc_sums_f16_n64 : ssd_bwd_bc_sums_f16_n128);
            CK(cudaFuncSetAttribute(bc, cudaFuncAttributeMaxDynamicSharedMemorySize, bc_smem));
            launch_pdl(bc, dim3(units, 2), unsigned(2 * chunk), bc_smem);
        }
        launch_pdl(ssd_bwd_reduce_params, dim3(unsigned(H)), 64, 0);
        CK(cudaGetLastError());
    };
    launch();
    CK(cudaDeviceSynchronize());
    if (timing) {
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        auto median_us = [&](int stages) {
            std::vector<float> ts;
            for (int i = 0; i < 10; ++i) {
                CK(cudaEventRecord(e0));
                launch(stages);
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                float ms;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                ts.push_back(ms * 1000.f);
            }
            std::sort(ts.begin(), ts.end());
            return ts[5];
        };
        printf("TIME %.1f us (backward kernels incl. reductions; the main kernel alone %.1f us; the head sums and reductions %.1f us)\n",
               median_us(3), median_us(1), median_us(2));
        return 0;
    }

    bool ok = true;
    auto cmp = [&](const char* name, const std::vector<double>& ref, const std::vector<float>& got, double tol) {
        double e = 0, r = 0;
        for (size_t i = 0; i < ref.size(); ++i) e += (got[i] - ref[i]) * (got[i] - ref[i]), r += ref[i] * ref[i];
        const double rel = sqrt(e / std::max(r, 1e-30));
        const bool good = rel < tol && std::isfinite(rel);
        ok = ok && good;
        printf("  %-6s rel L2 %.2e %s\n", name, rel, good ? "" : "FAIL");
    };
    const double tol = g_bf16 ? 2e-2 : 6e-3;
    cmp("dx", rdx, host_t(dx_d, x.size()), tol);
    cmp("ddt", rddt, host_t(ddt_d, dt.size()), tol);
    cmp("dB", rdB, host_t(dB_d, Bv.size()), tol);
    cmp("dC", rdC, host_t(dC_d, Cv.size()), tol);
    cmp("dA", rdA, host_f32(dA_d, H), tol);
    if (d_mode) cmp("dD", rdD, host_f32(dD_d, Dv.size()), tol);
    if (has_bias) cmp("dbias", rdbias, host_f32(dbias_d, H), tol);
    cmp("dh0", rdh0, host_f32(dh0_d, h0.size()), tol);
    // Deterministic: a second run gives bitwise the same gradients.
    {
        const std::vector<float> dx1 = host_t(dx_d, x.size()), dB1 = host_t(dB_d, Bv.size()), dC1 = host_t(dC_d, Cv.size());
        launch();
        CK(cudaDeviceSynchronize());
        const std::vector<float> dx2 = host_t(dx_d, x.size()), dB2 = host_t(dB_d, Bv.size()), dC2 = host_t(dC_d, Cv.size());
        auto same = [](const std::vector<float>& u, const std::vector<float>& v) {
            return u.size() == v.size() && memcmp(u.data(), v.data(), u.size() * sizeof(float)) == 0;
        };
        const bool repeat = same(dx1, dx2) && same(dB1, dB2) && same(dC1, dC2);
        printf("  rerun  %s\n", repeat ? "bitwise equal" : "DIFFERS FAIL");
        ok = ok && repeat;
    }
    printf("%s\n", ok ? "OK" : "FAIL");
    return ok ? 0 : 1;
}
