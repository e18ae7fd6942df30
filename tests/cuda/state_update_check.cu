// Checks and times the decode kernels (kernels/selective_state_update.cu) on one shape without XLA,
// on the GPU machine (tests/cuda/run.sh builds and runs it): each variant's state, output (and conv
// state) against a CPU reference, then the CUDA-event time of a CUDA graph of launches, next to the
// device-to-device copy of the state's bytes (the chip's HBM copy rate); exit 1 on any mismatch.
// bf16 x, dt, z, B, C; f32 state, A, D, dt_bias, softplus; fused: width 4, f32 conv weight and bias,
// bf16 conv state.
//   state_update_check batch dim dstate [groups] [pool 0|1] [only=name,name] [profile]
// `pool`: a pool of batch + batch / 4 + 1 state slots addressed through state_batch_indices, some
// entries -1 (padding). `profile`: each selected variant launched once, nothing timed (for ncu).
#include "../../kernels/selective_state_update.cu"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#define CHECK(x)                                                                                  \
    do {                                                                                          \
        cudaError_t e = (x);                                                                      \
        if (e != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));     \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

// The fast kernel at each block size tried, without the library's register cap.
template <int Block>
__global__ void __launch_bounds__(Block) fast_update(const StateUpdateParams p) {
    rows_fast<bf16, bf16, f32, bf16, false>(DecodeParams{p, nullptr, nullptr, nullptr, 0});
}
template <int Block>
__global__ void __launch_bounds__(Block) fast_decode(const DecodeParams q) {
    rows_fast<bf16, bf16, f32, f32, true>(q);
}

__global__ void copy_f4(const float4* __restrict__ src, float4* __restrict__ dst, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) __stcs(dst + i, __ldcs(src + i));
}

static uint64_t rng = 88172645463325252ull;
static float uniform() {  // [0, 1)
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (rng >> 40) / float(1 << 24);
}
static float normalish() { return (uniform() + uniform() + uniform() - 1.5f) * 2.f; }
static float bf(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
static std::vector<bf16> to_bf16(const std::vector<float>& v) {
    std::vector<bf16> o(v.size());
    for (size_t i = 0; i < v.size(); ++i) o[i] = __float2bfloat16_rn(v[i]);
    return o;
}
template <typename T>
static T* upload(const std::vector<T>& v) {
    T* p;
    CHECK(cudaMalloc(&p, std::max<size_t>(v.size(), 1) * sizeof(T)));
    CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
}
template <typename T>
static std::vector<T> download(const T* p, size_t n) {
    std::vector<T> v(n);
    CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
}

struct Variant {
    std::string name;
    bool fused;
    std::function<void(cudaStream_t)> launch;
};

int main(int argc, char** argv) {
    if (argc < 4) return fprintf(stderr, "usage: %s batch dim dstate [groups] [pool] [only=a,b] [profile]\n", argv[0]), 2;
    const int64_t batch = atoll(argv[1]), dim = atoll(argv[2]), N = atoll(argv[3]);
    const int64_t groups = argc > 4 ? atoll(argv[4]) : 1;
    const bool pool = argc > 5 && atoi(argv[5]) != 0;
    std::string only;
    bool profile = false;
    for (int i = 6; i < argc; ++i) {
        if (!strncmp(argv[i], "only=", 5)) only = std::string(",") + (argv[i] + 5) + ",";
        if (!strcmp(argv[i], "profile")) profile = true;
    }
    const int W = 4, lanes = (int)std::min<int64_t>(32, std::max<int64_t>(1, N / 4));
    if (N != 4 * lanes) return fprintf(stderr, "dstate must be 4, 8, .., 128 (one float4 per lane)\n"), 2;
    const int64_t slots = pool ? batch + batch / 4 + 1 : batch;
    const int64_t rows = batch * dim, dpg = dim / groups;

    // Inputs (bench/bench_decode.py's distributions).
    std::vector<float> state(slots * dim * N), x(rows), dt(rows), z(rows), Bm(batch * groups * N),
        Cm(batch * groups * N), A(dim * N), Dv(dim), bias(dim), cs(slots * dim * (W - 1)), cw(dim * W), cb(dim);
    for (auto& v : state) v = normalish();
    for (auto& v : x) v = bf(normalish());
    for (auto& v : dt) v = bf(0.5f * normalish());
    for (auto& v : z) v = bf(normalish());
    for (auto& v : Bm) v = bf(normalish());
    for (auto& v : Cm) v = bf(normalish());
    for (auto& v : A) v = -(0.1f + 1.9f * uniform());
    for (auto& v : Dv) v = normalish();
    for (auto& v : bias) v = 0.3f * normalish();
    for (auto& v : cs) v = bf(normalish());
    for (auto& v : cw) v = 0.5f * normalish();
    for (auto& v : cb) v = normalish();
    std::vector<int32_t> idx(batch);
    if (pool) {  // distinct slots in shuffled order, every 7th row padding
        std::vector<int32_t> perm(slots);
        for (int64_t i = 0; i < slots; ++i) perm[i] = (int32_t)i;
        for (int64_t i = slots - 1; i > 0; --i) std::swap(perm[i], perm[(int64_t)(uniform() * (i + 1)) % (i + 1)]);
        for (int64_t b = 0; b < batch; ++b) idx[b] = b % 7 == 3 ? -1 : perm[b];
    }

    // CPU reference, both ops (the fused one's x is the conv output).
    auto softplus_h = [](float v) { return v > 20.f ? v : log1pf(expf(v)); };
    auto silu_h = [](float v) { return v / (1.f + expf(-v)); };
    auto reference = [&](bool fused, std::vector<float>& st, std::vector<float>& out, std::vector<float>& conv) {
        st = state, conv = cs, out.assign(rows, 0.f);
        for (int64_t b = 0; b < batch; ++b) {
            const int64_t s = pool ? idx[b] : b;
            if (s < 0) continue;
            for (int64_t d = 0; d < dim; ++d) {
                const int64_t row = b * dim + d;
                float xv = x[row];
                if (fused) {
                    float* c = &conv[(s * dim + d) * (W - 1)];
                    float acc = cb[d];
                    for (int k = 0; k < W - 1; ++k) acc += cw[d * W + k] * c[k];
                    acc += cw[d * W + W - 1] * xv;
                    for (int k = 0; k < W - 2; ++k) c[k] = c[k + 1];
                    c[W - 2] = xv;
                    xv = silu_h(acc);
                }
                const float dtv = softplus_h(dt[row] + bias[d]);
                const int64_t bc = (b * groups + d / dpg) * N;
                float y = 0.f;
                for (int64_t n = 0; n < N; ++n) {
                    float& h = st[(s * dim + d) * N + n];
                    h = expf(dtv * A[d * N + n]) * h + dtv * Bm[bc + n] * xv;
                    y += Cm[bc + n] * h;
                }
                out[row] = (y + Dv[d] * xv) * silu_h(z[row]);
            }
        }
    };

    float* d_state0 = upload(state);
    float* d_state = upload(state);
    bf16 *d_x = upload(to_bf16(x)), *d_dt = upload(to_bf16(dt)), *d_z = upload(to_bf16(z));
    bf16 *d_B = upload(to_bf16(Bm)), *d_C = upload(to_bf16(Cm));
    bf16 *d_cs0 = upload(to_bf16(cs)), *d_cs = upload(to_bf16(cs)), *d_out = upload(std::vector<bf16>(rows));
    float *d_A = upload(A), *d_D = upload(Dv), *d_bias = upload(bias), *d_cw = upload(cw), *d_cb = upload(cb);
    int32_t* d_idx = upload(idx);
    float* d_copy = upload(std::vector<float>(slots * dim * N));

    StateUpdateParams p{};
    p.state = d_state, p.x = d_x, p.dt = d_dt, p.A = d_A, p.B = d_B, p.C = d_C, p.D = d_D, p.z = d_z;
    p.dt_bias = d_bias, p.state_batch_indices = pool ? d_idx : nullptr, p.out = d_out;
    p.batch = batch, p.dim = dim, p.dstate = N, p.groups = groups, p.dim_per_group = dpg, p.n_slots = slots;
    p.dt_softplus = 1, p.vectorized = 1, p.lanes = lanes;
    const DecodeParams q{p, d_cs, d_cw, d_cb, W};

    std::vector<Variant> variants;
    // The general kernels, as the library launches them (128 threads, flat rows).
    const unsigned general_grid = (unsigned)((rows + 128 / lanes - 1) / (128 / lanes));
    variants.push_back({"general/128", false, [=](cudaStream_t s) {
                            selective_state_update_bf16_bf16_f32<<<general_grid, 128, 0, s>>>(p);
                        }});
    variants.push_back({"general-fused/128", true, [=](cudaStream_t s) {
                            mamba_decode_step_bf16_bf16_f32_f32<<<general_grid, 128, 0, s>>>(q);
                        }});
    // The library's fast kernels, launched as src/cuda/state_update.rs does (there only when
    // dim * lanes >= 128 and, fused, lanes >= the conv width).
    {
        const int64_t per_block = kFastBlock / lanes;
        const dim3 grid((unsigned)((dim + per_block - 1) / per_block), (unsigned)std::min<int64_t>(batch, 65535));
        variants.push_back({"lib-fast", false, [=](cudaStream_t s) {
                                selective_state_update_bf16_bf16_f32_fast<<<grid, kFastBlock, 0, s>>>(p);
                            }});
        if (lanes >= W)
            variants.push_back({"lib-fast-fused", true, [=](cudaStream_t s) {
                                    mamba_decode_step_bf16_bf16_f32_f32_fast<<<grid, kFastBlock, 0, s>>>(q);
                                }});
    }
    // The fast kernels without the library's register cap, at each block (on any dim: a block
    // shrinks to the row's width, >= 32 threads).
    auto fast = [&](auto block_tag) {
        constexpr int Block = decltype(block_tag)::value;
        int threads = 32;
        while (threads < Block && threads < dim * lanes) threads *= 2;
        const int64_t per_block = threads / lanes;
        const dim3 grid((unsigned)((dim + per_block - 1) / per_block), (unsigned)std::min<int64_t>(batch, 65535));
        const std::string tag = std::to_string(Block);
        variants.push_back({"fast/" + tag, false, [=](cudaStream_t s) { fast_update<Block><<<grid, threads, 0, s>>>(p); }});
        if (lanes >= W)  // the fused fast kernel's condition: a conv tap per lane
            variants.push_back({"fast-fused/" + tag, true, [=](cudaStream_t s) { fast_decode<Block><<<grid, threads, 0, s>>>(q); }});
    };
    fast(std::integral_constant<int, 64>{}), fast(std::integral_constant<int, 128>{});

    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    const size_t state_bytes = slots * dim * N * 4;
    const double bytes = 2.0 * batch * dim * N * 4 + 4.0 * rows * 2 + 2.0 * batch * groups * N * 2 + dim * N * 4 + 2.0 * dim * 4;
    const double fused_bytes = bytes + 2.0 * rows * (W - 1) * 2 + dim * (W + 1) * 4;
    printf("%s, %d SMs; batch %lld dim %lld dstate %lld groups %lld pool %d (slots %lld)\n",
           prop.name, prop.multiProcessorCount, (long long)batch, (long long)dim, (long long)N, (long long)groups,
           (int)pool, (long long)slots);

    // Median over 15 replays of a graph of `reps` launches, per launch (us).
    auto time_graph = [&](const std::function<void(cudaStream_t)>& f) {
        const int reps = 20;
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < reps; ++i) f(stream);
        CHECK(cudaStreamEndCapture(stream, &g));
        CHECK(cudaGraphInstantiate(&ge, g, 0));
        cudaEvent_t e0, e1;
        CHECK(cudaEventCreate(&e0));
        CHECK(cudaEventCreate(&e1));
        for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(ge, stream));
        std::vector<float> t;
        for (int i = 0; i < 15; ++i) {
            CHECK(cudaEventRecord(e0, stream));
            CHECK(cudaGraphLaunch(ge, stream));
            CHECK(cudaEventRecord(e1, stream));
            CHECK(cudaEventSynchronize(e1));
            float ms;
            CHECK(cudaEventElapsedTime(&ms, e0, e1));
            t.push_back(ms * 1e3f / reps);
        }
        std::sort(t.begin(), t.end());
        CHECK(cudaGraphExecDestroy(ge));
        CHECK(cudaGraphDestroy(g));
        return (double)t[t.size() / 2];
    };

    double copy_rate = 0;
    if (!profile && state_bytes > 0) {
        const double t = time_graph([&](cudaStream_t s) { CHECK(cudaMemcpyAsync(d_copy, d_state0, state_bytes, cudaMemcpyDeviceToDevice, s)); });
        copy_rate = 2.0 * state_bytes / (t * 1e-6) / 1e12;
        const int64_t n4 = state_bytes / 16;
        const double tk = time_graph([&](cudaStream_t s) {
            copy_f4<<<(unsigned)((n4 + 255) / 256), 256, 0, s>>>((const float4*)d_state0, (float4*)d_copy, n4);
        });
        printf("copy of the state's %.1f MB: cudaMemcpyAsync %.2f us = %.3f TB/s; float4 kernel %.2f us = %.3f TB/s\n",
               state_bytes / 1e6, t, copy_rate, tk, 2.0 * state_bytes / (tk * 1e-6) / 1e12);
    }

    std::vector<float> ref_st[2], ref_out[2], ref_conv[2];
    reference(false, ref_st[0], ref_out[0], ref_conv[0]);
    reference(true, ref_st[1], ref_out[1], ref_conv[1]);
    int failures = 0;
    for (const Variant& v : variants) {
        if (!only.empty() && only.find("," + v.name + ",") == std::string::npos) continue;
        CHECK(cudaMemcpy(d_state, d_state0, state_bytes, cudaMemcpyDeviceToDevice));
        CHECK(cudaMemcpy(d_cs, d_cs0, cs.size() * 2, cudaMemcpyDeviceToDevice));
        CHECK(cudaMemset(d_out, 0xff, rows * 2));  // NaN: an unwritten output fails
        v.launch(stream);
        CHECK(cudaGetLastError());
        CHECK(cudaStreamSynchronize(stream));
        if (profile) {
            printf("%-22s launched\n", v.name.c_str());
            continue;
        }
        const int f = v.fused;
        const auto st = download(d_state, state.size());
        const auto out = download(d_out, rows);
        const auto conv = download(d_cs, cs.size());
        double err_st = 0, err_out = 0, err_conv = 0;
        for (size_t i = 0; i < st.size(); ++i)
            err_st = std::max(err_st, (double)fabsf(st[i] - ref_st[f][i]) / (1.0 + fabsf(ref_st[f][i])));
        for (int64_t i = 0; i < rows; ++i) {
            const float g = __bfloat162float(out[i]);
            const double e = std::isnan(g) ? INFINITY : fabsf(g - ref_out[f][i]) / (1.0 + fabsf(ref_out[f][i]));
            err_out = std::max(err_out, e);
        }
        if (f)
            for (size_t i = 0; i < conv.size(); ++i) err_conv = std::max(err_conv, (double)fabsf(__bfloat162float(conv[i]) - ref_conv[1][i]));
        const bool ok = err_st < 1e-4 && err_out < 1.6e-2 && err_conv == 0;
        failures += !ok;
        const double t = time_graph(v.launch);
        const double tbps = (f ? fused_bytes : bytes) / (t * 1e-6) / 1e12;
        printf("%-22s %s (state %.1e, out %.1e, conv %.1e)  %8.2f us  %.3f TB/s  %.0f%% of copy\n", v.name.c_str(),
               ok ? "ok  " : "FAIL", err_st, err_out, err_conv, t, tbps, copy_rate > 0 ? 100 * tbps / copy_rate : 0.0);
    }
    return failures ? 1 : 0;
}
