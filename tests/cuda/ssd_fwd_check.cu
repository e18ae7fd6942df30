// Standalone check and timing of the tensor-core SSD forward (kernels/ssd_fwd.cu), for a GPU machine
// without Rust (tests/cuda/run.sh builds and runs it).
//   ssd_fwd_check check|time batch seqlen heads groups dstate dtype chunk D z bias softplus h0 clamp parts
// D: 0 none, 1 per head, 2 per channel; parts: 0 = the launcher's choice. `check` compares y, the final
// and the chunk states with a double-precision recurrence (a sample of heads when the shape is large);
// `time` also times a device-to-device copy of the bytes the kernel must move.
#include "../../kernels/ssd_fwd.cu"
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

static float round_to(float v, bool is_bf16) {
    return is_bf16 ? __bfloat162float(__float2bfloat16(v)) : __half2float(__float2half(v));
}

template <typename T> static T* upload(const std::vector<float>& v) {
    std::vector<T> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = T(v[i]);
    T* d;
    CK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)));
    CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}
static float* upload_f32(const std::vector<float>& v) {
    float* d;
    CK(cudaMalloc(&d, std::max<size_t>(v.size(), 1) * 4));
    CK(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    return d;
}

// Whether the kernels run the wgmma first pass at dstate 128 (built for sm_90a: tests/cuda/run.sh
// passes 0 for other builds), which takes the launcher's Pieces::OneWave rule.
#ifndef SSD_WGMMA
#define SSD_WGMMA 1
#endif

// The launcher's split choice (mirrored in src/ops/ssd/plan.rs, mma_fwd_split): as many parts as
// fit one wave of two blocks per SM (a second, partial wave would cost a whole one).
static int64_t split_parts(int64_t batch_heads, int64_t n_tiles) {
    const int64_t want = 2 * 132 / batch_heads;
    return std::max<int64_t>(1, std::min(want, n_tiles));
}

template <typename T, int N> struct Kern {
    static void run(const SsdParams& p, int64_t parts, cudaStream_t st) {
        const int64_t n_tiles = (p.seqlen + 63) / 64;
        const int64_t tpp = std::max<int64_t>(1, (n_tiles + parts - 1) / parts);
        parts = std::max<int64_t>(1, (n_tiles + tpp - 1) / tpp);
        const int64_t rpp = records_per_part(p.batch * p.heads, parts, tpp, "SSD_FWD_RECORDS", N == 128 && SSD_WGMMA);
        const int smem = sizeof(ssd_mma::SyncSmem<T, N>);  // the launcher's size (kernels/ssd_fwd.cu)
#define SSD_PICK(NAME) (std::is_same<T, bf16>::value ? (N == 64 ? NAME##_bf16_n64 : NAME##_bf16_n128) \
                                                    : (N == 64 ? NAME##_f16_n64 : NAME##_f16_n128))
        auto main_k = p.z ? SSD_PICK(ssd_fwd_mma_gated) : SSD_PICK(ssd_fwd_mma);  // the launcher's choice
        auto local_k = SSD_PICK(ssd_fwd_mma_local);
        CK(cudaFuncSetAttribute(main_k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        CK(cudaFuncSetAttribute(local_k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        SsdMmaParams a = {p, {tpp, parts, rpp}, 0};
        // The launcher's scalars parked in y's rows ahead of the wgmma kernel (src/cuda/ssd_mma.rs,
        // `park_tile_scalars`); SSD_FORM_SCALARS=1: the kernel forms them all itself.
        const int64_t units = p.batch * (p.seqlen / 64) * ((p.heads + 3) / 4);
        if (N == 128 && SSD_WGMMA && units > 0 && !getenv("SSD_FORM_SCALARS")) {
            auto park = std::is_same<T, bf16>::value ? ssd_fwd_tile_scalars_bf16 : ssd_fwd_tile_scalars_f16;
            park<<<unsigned(std::min<int64_t>(units, 4096)), 128, 0, st>>>(a);
            a.scalars_in_y = 1;
        }
        if (parts > 1)
            local_k<<<dim3(unsigned(p.batch * p.heads), unsigned((parts - 1) * rpp)), ssd_mma::kThreads, smem, st>>>(a);
        main_k<<<dim3(unsigned(p.batch * p.heads), unsigned(parts)), ssd_mma::kThreads, smem, st>>>(a);
        CK(cudaGetLastError());
    }
};

int main(int argc, char** argv) {
    if (argc != 16) {
        fprintf(stderr, "usage: %s check|time batch seqlen heads groups dstate bf16|f16 chunk D z bias softplus h0 clamp parts\n", argv[0]);
        return 2;
    }
    const bool timing = !strcmp(argv[1], "time");
    const int64_t B = atoll(argv[2]), L = atoll(argv[3]), H = atoll(argv[4]), G = atoll(argv[5]), N = atoll(argv[6]);
    const bool is_bf16 = !strcmp(argv[7], "bf16");
    const int64_t chunk = atoll(argv[8]);
    const int d_mode = atoi(argv[9]);
    const bool has_z = atoi(argv[10]), has_bias = atoi(argv[11]), softplus_on = atoi(argv[12]), has_h0 = atoi(argv[13]),
               clamp = atoi(argv[14]);
    int64_t parts = atoll(argv[15]);
    const int64_t P = 64;
    const int64_t n_tiles = (L + 63) / 64, n_chunks = (L + chunk - 1) / chunk;
    if (parts == 0) parts = split_parts(B * H, n_tiles);
    printf("%s b=%lld l=%lld h=%lld g=%lld n=%lld %s chunk=%lld D=%d z=%d bias=%d sp=%d h0=%d clamp=%d parts=%lld\n", argv[1],
           (long long)B, (long long)L, (long long)H, (long long)G, (long long)N, argv[7], (long long)chunk, d_mode, has_z,
           has_bias, softplus_on, has_h0, clamp, (long long)parts);

    std::mt19937 rng(1234);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    auto fill = [&](size_t n, float scale, float shift = 0.f) {
        std::vector<float> v(n);
        for (auto& e : v) e = round_to(shift + scale * uni(rng), is_bf16);
        return v;
    };
    std::vector<float> x = fill(B * L * H * P, 1.f), dt = fill(B * L * H, 1.f, softplus_on ? -2.f : 0.15f);
    if (!softplus_on)
        for (auto& e : dt) e = fabsf(e);
    std::vector<float> Bv = fill(B * L * G * N, 1.f), Cv = fill(B * L * G * N, 1.f);
    std::vector<float> z = has_z ? fill(B * L * H * P, 2.f) : std::vector<float>();
    std::vector<float> A(H), Dv, bias, h0;
    for (auto& e : A) e = -expf(1.5f * uni(rng));
    if (d_mode) {
        Dv.resize(d_mode == 1 ? H : H * P);
        for (auto& e : Dv) e = uni(rng);
    }
    if (has_bias) {
        bias.resize(H);
        for (auto& e : bias) e = 0.5f * uni(rng);
    }
    if (has_h0) h0 = fill(B * H * P * N, 1.f);
    const float dt_min = clamp ? 0.02f : 0.f, dt_max = clamp ? 0.5f : INFINITY;

    SsdParams p = {};
    void *x_d, *dt_d, *B_d, *C_d, *z_d = nullptr, *y_d;
    if (is_bf16) {
        x_d = upload<bf16>(x), dt_d = upload<bf16>(dt), B_d = upload<bf16>(Bv), C_d = upload<bf16>(Cv);
        if (has_z) z_d = upload<bf16>(z);
    } else {
        x_d = upload<f16>(x), dt_d = upload<f16>(dt), B_d = upload<f16>(Bv), C_d = upload<f16>(Cv);
        if (has_z) z_d = upload<f16>(z);
    }
    CK(cudaMalloc(&y_d, B * L * H * P * 2 + 2));
    float *fin_d, *cs_d, *ws_d;
    CK(cudaMalloc(&fin_d, B * H * P * N * 4 + 4));
    CK(cudaMalloc(&cs_d, B * H * P * n_chunks * N * 2 + 4));  // in T
    // Room for the records of any split the launch may choose (at most one per tile).
    const int64_t ws_bytes = n_tiles * B * H * (P * N + 1) * 4;
    CK(cudaMalloc(&ws_d, ws_bytes + 4));
    p.x = x_d, p.dt = dt_d, p.A = upload_f32(A), p.B = B_d, p.C = C_d;
    p.D = d_mode ? upload_f32(Dv) : nullptr;
    p.z = z_d;
    p.dt_bias = has_bias ? upload_f32(bias) : nullptr;
    p.initial_states = has_h0 ? upload_f32(h0) : nullptr;
    // SSD_NO_CHUNK_STATES=1: the inference forward (no residuals for the backward pass).
    const bool save_chunks = !getenv("SSD_NO_CHUNK_STATES");
    p.y = y_d, p.final_states = fin_d, p.chunk_states = save_chunks ? cs_d : nullptr, p.workspace = ws_d;
    p.workspace_bytes = ws_bytes;
    p.batch = B, p.seqlen = L, p.heads = H, p.headdim = P, p.dstate = N, p.groups = G, p.chunk_size = chunk;
    p.dt_min = dt_min, p.dt_max = dt_max, p.dt_softplus = softplus_on, p.D_per_channel = d_mode == 2;

    auto launch = [&](cudaStream_t st) {
        if (is_bf16) {
            if (N == 64) Kern<bf16, 64>::run(p, parts, st); else Kern<bf16, 128>::run(p, parts, st);
        } else {
            if (N == 64) Kern<f16, 64>::run(p, parts, st); else Kern<f16, 128>::run(p, parts, st);
        }
    };
    launch(0);
    CK(cudaDeviceSynchronize());

    if (timing) {
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        const int iters = 20;
        std::vector<float> ts;
        for (int i = 0; i < iters; ++i) {
            CK(cudaEventRecord(e0));
            launch(0);
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            ts.push_back(ms * 1000.f);
        }
        std::sort(ts.begin(), ts.end());
        const double us = ts[iters / 2];
        // Bytes the forward must move: x, y (, z) in T, dt, B, C, the chunk states.
        const double bytes = 2.0 * B * L * H * P * (2 + has_z) + 2.0 * B * L * H + 2.0 * 2 * B * L * G * N +
                             (save_chunks ? 2.0 * B * H * P * n_chunks * N : 0.0);
        void *c0, *c1;
        CK(cudaMalloc(&c0, size_t(bytes / 2) + 16));
        CK(cudaMalloc(&c1, size_t(bytes / 2) + 16));
        std::vector<float> tc;
        for (int i = 0; i < iters; ++i) {
            CK(cudaEventRecord(e0));
            CK(cudaMemcpyAsync(c1, c0, size_t(bytes / 2), cudaMemcpyDeviceToDevice));
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            tc.push_back(ms * 1000.f);
        }
        std::sort(tc.begin(), tc.end());
        // Causal useful tensor work with 64-step tiles: C B^T (half), (.) x (half), C S^T, x^T B.
        const double macs = double(B) * H * L * (32.0 * N + 32.0 * P + 2.0 * P * N);
        printf("TIME %.1f us | copy of %.0f MB: %.1f us (%.2f TB/s) -> %.2fx copy | %.0f TFLOP/s useful\n", us,
               bytes / 1e6, tc[iters / 2], bytes / tc[iters / 2] / 1e6, us / tc[iters / 2], 2 * macs / us / 1e6);
    }

    // Reference: double recurrence over a sample of (b, h).
    std::vector<uint16_t> y_raw(B * L * H * P);
    std::vector<float> fin(B * H * P * N), cs(B * H * P * n_chunks * N);
    std::vector<uint16_t> cs_raw(cs.size());  // the chunk states, in T
    CK(cudaMemcpy(y_raw.data(), y_d, y_raw.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(fin.data(), fin_d, fin.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(cs_raw.data(), cs_d, cs_raw.size() * 2, cudaMemcpyDeviceToHost));
    auto t_to_f32 = [&](uint16_t r) {
        if (is_bf16) {
            uint32_t u = uint32_t(r) << 16;
            float f;
            memcpy(&f, &u, 4);
            return f;
        }
        __half hv;
        memcpy(&hv, &r, 2);
        return __half2float(hv);
    };
    auto y_at = [&](size_t i) { return t_to_f32(y_raw[i]); };
    for (size_t i = 0; i < cs_raw.size(); ++i) cs[i] = t_to_f32(cs_raw[i]);
    const int64_t pairs = B * H;
    const int64_t stride = timing || pairs * L > 200000 ? std::max<int64_t>(1, pairs / 6) : 1;
    double ey = 0, ry = 0, es = 0, rs = 0, ec = 0, rc = 0, maxy = 0;
    std::vector<double> S(P * N);
    for (int64_t bh = 0; bh < pairs; bh += stride) {
        const int64_t b = bh / H, h = bh % H, g = h / (H / G);
        for (int64_t i = 0; i < P * N; ++i) S[i] = has_h0 ? h0[bh * P * N + i] : 0.0;
        for (int64_t t = 0; t < L; ++t) {
            if (t % chunk == 0 && save_chunks)
                for (int64_t i = 0; i < P * N; ++i) {
                    const int64_t pp = i / N, n = i % N;
                    const double got = cs[((bh * P + pp) * n_chunks + t / chunk) * N + n];
                    ec += (got - S[i]) * (got - S[i]);
                    rc += S[i] * S[i];
                }
            double d = dt[(b * L + t) * H + h] + (has_bias ? bias[h] : 0.0);
            if (softplus_on) d = d > 20 ? d : log1p(exp(d));
            d = std::min<double>(std::max<double>(d, dt_min), dt_max);
            const double decay = exp(d * A[h]);
            const float* Bt = &Bv[((b * L + t) * G + g) * N];
            const float* Ct = &Cv[((b * L + t) * G + g) * N];
            for (int64_t pp = 0; pp < P; ++pp) {
                const int64_t xi = ((b * L + t) * H + h) * P + pp;
                double acc = 0;
                for (int64_t n = 0; n < N; ++n) {
                    double& s = S[pp * N + n];
                    s = decay * s + d * x[xi] * Bt[n];
                    acc += s * Ct[n];
                }
                if (d_mode) acc += Dv[d_mode == 1 ? h : h * P + pp] * x[xi];
                if (has_z) acc *= z[xi] / (1.0 + exp(-z[xi]));
                const double got = y_at(xi);
                ey += (got - acc) * (got - acc);
                ry += acc * acc;
                maxy = std::max(maxy, fabs(got - acc));
            }
        }
        for (int64_t i = 0; i < P * N; ++i) {
            const double got = fin[bh * P * N + i];
            es += (got - S[i]) * (got - S[i]);
            rs += S[i] * S[i];
        }
    }
    const double rel_y = sqrt(ey / std::max(ry, 1e-30)), rel_s = sqrt(es / std::max(rs, 1e-30)),
                 rel_c = sqrt(ec / std::max(rc, 1e-30));
    const double tol = is_bf16 ? 1.5e-2 : 4e-3;
    const bool ok = rel_y < tol && rel_s < tol && rel_c < tol && std::isfinite(rel_y + rel_s + rel_c);
    printf("%s rel L2: y %.2e (max abs %.2e) final %.2e chunk states %.2e (tol %.0e)\n", ok ? "OK  " : "FAIL", rel_y, maxy,
           rel_s, rel_c, tol);
    return ok ? 0 : 1;
}
