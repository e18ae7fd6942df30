// Times build variants of the forward kernels on one shape, without XLA: for tuning on the GPU
// machine (bench/fwd_variants.sh compiles this file once per set of -D knobs, for sm_90a).
// Checks every variant's output against the `lanes` kernel.
//   fwd_variants batch dim seqlen dstate layout(bdl|bld) [iters]
#include "fwd_ws.cuh"  // the warp-specialized experiment; it includes kernels/selective_scan_fwd.cu

#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#define CHECK(x)                                                                      \
    do {                                                                              \
        cudaError_t e = (x);                                                          \
        if (e != cudaSuccess) {                                                       \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)

__global__ void fill_normalish(bf16* x, int64_t n, uint32_t seed, float scale, float shift) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        uint32_t h = uint32_t(i) * 2654435761u ^ seed;
        h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
        const float r = (h & 0xffffff) / float(1 << 24);  // uniform [0,1)
        x[i] = __float2bfloat16((r * 2.f - 1.f) * 1.7f * scale + shift);
    }
}

int main(int argc, char** argv) {
    if (argc < 6) return fprintf(stderr, "usage: %s batch dim seqlen dstate bdl|bld [iters]\n", argv[0]), 2;
    const int64_t B = atoll(argv[1]), D = atoll(argv[2]), L = atoll(argv[3]), N = atoll(argv[4]);
    const bool bld = argv[5][1] == 'l';
    const int iters = argc > 6 ? atoi(argv[6]) : 20;
    const int64_t nx = B * D * L, nbc = B * N * L;
    bf16 *u, *dt, *z, *out, *out_ref, *Bm, *Cm;
    float *A, *Dv, *bias, *fs;
    CHECK(cudaMalloc(&u, nx * 2)); CHECK(cudaMalloc(&dt, nx * 2)); CHECK(cudaMalloc(&z, nx * 2));
    CHECK(cudaMalloc(&out, nx * 2)); CHECK(cudaMalloc(&out_ref, nx * 2));
    CHECK(cudaMalloc(&Bm, nbc * 2)); CHECK(cudaMalloc(&Cm, nbc * 2));
    CHECK(cudaMalloc(&A, D * N * 4)); CHECK(cudaMalloc(&Dv, D * 4)); CHECK(cudaMalloc(&bias, D * 4));
    CHECK(cudaMalloc(&fs, B * D * N * 4));
    fill_normalish<<<1024, 256>>>(u, nx, 1, 1.f, 0.f);
    fill_normalish<<<1024, 256>>>(dt, nx, 2, 0.5f, -3.f);
    fill_normalish<<<1024, 256>>>(z, nx, 3, 1.f, 0.f);
    fill_normalish<<<1024, 256>>>(Bm, nbc, 4, 1.f, 0.f);
    fill_normalish<<<1024, 256>>>(Cm, nbc, 5, 1.f, 0.f);
    std::vector<float> hA(D * N), hD(D, 1.f), hb(D, 0.f);
    for (int64_t i = 0; i < D * N; ++i) hA[i] = -float(i % N + 1);
    CHECK(cudaMemcpy(A, hA.data(), D * N * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(Dv, hD.data(), D * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(bias, hb.data(), D * 4, cudaMemcpyHostToDevice));

    SelectiveScanFwdParams p{};
    p.u = u, p.delta = dt, p.A = A, p.B = Bm, p.C = Cm, p.D = Dv, p.z = z, p.delta_bias = bias;
    p.out = out, p.final_state = fs;
    p.batch = B, p.dim = D, p.seqlen = L, p.dstate = N, p.dim_per_group = D;
    if (bld) {
        p.x_stride_batch = L * D, p.x_stride_dim = 1, p.x_stride_seq = D;
        p.bc_stride_batch = L * N, p.bc_stride_group = N, p.bc_stride_state = 1, p.bc_stride_seq = N;
    } else {
        p.x_stride_batch = D * L, p.x_stride_dim = L, p.x_stride_seq = 1;
        p.bc_stride_batch = N * L, p.bc_stride_group = N * L, p.bc_stride_state = L, p.bc_stride_seq = 1;
    }
    p.delta_softplus = 1;
    p.chunk_len = L, p.n_chunks = 1;
    // SSF_CHECKPOINT_LEN=64 (a multiple of 32): also write the backward's checkpoints (training).
    if (const char* ckl = getenv("SSF_CHECKPOINT_LEN")) {
        p.checkpoint_len = atoll(ckl);
        CHECK(cudaMalloc(&p.checkpoints, B * D * ((L + p.checkpoint_len - 1) / p.checkpoint_len) * N * 4));
    }
    // The sequence split of src/ops/selective_scan/mod.rs (split_plan) for small batch x dim.
    int tpc = N <= 16 ? 2 : N <= 32 ? 4 : N <= 64 ? 8 : N <= 128 ? 16 : 32;  // tiled_threads_per_channel
    if (N > 256) return fprintf(stderr, "dstate <= 256\n"), 2;
    SelectiveScanFwdParams ps = p;
    // Planned in 64-channel tiles at every dstate (split_plan).
    const int64_t tiles = B * ((D + kTileChannels - 1) / kTileChannels), target = 4 * 132;
    if (2 * tiles < target && L >= 128) {
        int64_t chunks = std::min(target / tiles, L / 64);
        if (getenv("SSF_CHUNKS")) chunks = atoll(getenv("SSF_CHUNKS"));  // another split to compare
        ps.chunk_len = ((L + chunks - 1) / chunks + 31) / 32 * 32;
        ps.n_chunks = (L + ps.chunk_len - 1) / ps.chunk_len;
        CHECK(cudaMalloc(&ps.workspace, (ps.n_chunks - 1) * B * D * (8 * tpc + 1) * 4));
    }
    // One thread of 16 states a channel in the pass that writes the outputs (cuda.rs): grids of at
    // least 7/8 of the target, unsplit or in chunks of at least 384 steps; SSF_TPC=1 or 2 forces
    // either at dstate <= 16 (the split's first pass stays at 2: the records are as long).
    const char* force_tpc = getenv("SSF_TPC");
    const bool one_thread = force_tpc ? atoi(force_tpc) == 1
                                      : tiles * ps.n_chunks >= target * 7 / 8 && (ps.n_chunks == 1 || ps.chunk_len >= 384);
    const int local_tpc = tpc;
    if (N <= 16 && one_thread) tpc = 1;

    // Reference: the lanes kernel.
    SelectiveScanFwdParams pr = p;
    pr.out = out_ref;
    // The reference's checkpoints, to check the tiled kernel's.
    const int64_t n_ckpt = p.checkpoint_len ? B * D * ((L + p.checkpoint_len - 1) / p.checkpoint_len) * N : 0;
    if (n_ckpt) CHECK(cudaMalloc(&pr.checkpoints, n_ckpt * 4));
    const int ns = N <= 8 ? 1 : N <= 16 ? 2 : N <= 32 ? 4 : N <= 64 ? 8 : N <= 128 ? 16 : 32;  // lanes_per_channel
    const int64_t lane_threads = B * D * ns;
    auto lanes = [&] {
        const unsigned grid = unsigned((lane_threads + 127) / 128);
        if (ns == 1) selective_scan_fwd_lanes_bf16_bf16_ns1<<<grid, 128>>>(pr);
        else if (ns == 2) selective_scan_fwd_lanes_bf16_bf16_ns2<<<grid, 128>>>(pr);
        else if (ns == 4) selective_scan_fwd_lanes_bf16_bf16_ns4<<<grid, 128>>>(pr);
        else if (ns == 8) selective_scan_fwd_lanes_bf16_bf16_ns8<<<grid, 128>>>(pr);
        else if (ns == 16) selective_scan_fwd_lanes_bf16_bf16_ns16<<<grid, 128>>>(pr);
        else selective_scan_fwd_lanes_bf16_bf16_ns32<<<grid, 128>>>(pr);
    };
    // The tiled kernel's launches: the split's first pass at local_tpc threads a channel, then the
    // pass that writes the outputs at tpc.
    bool local_only = false;  // time the split's first pass alone
    auto launch = [&](auto kernel, int channels, int threads, int smem, int64_t chunks) {
        CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        const dim3 grid(unsigned((D + channels - 1) / channels), unsigned(B), unsigned(chunks));
        kernel<<<grid, threads, smem>>>(ps);
    };
    // SSF_WS=1 (blockIdx order) or 2 (SM-major order): the output pass on the warp-specialized
    // experiment (bench/fwd_ws.cuh), bf16 at dstate 16 without a split; a persistent grid.
    const int ws = getenv("SSF_WS") ? atoi(getenv("SSF_WS")) : 0;
    if (ws && (N != 16 || ps.n_chunks != 1 || p.checkpoint_len)) return fprintf(stderr, "SSF_WS: dstate 16, no split, no checkpoints\n"), 2;
    // SSF_WS_SCALARS=0..3: where dt and the gate are computed (fwd_ws.cuh, kScalars).
    const int ws_scalars = getenv("SSF_WS_SCALARS") ? atoi(getenv("SSF_WS_SCALARS")) : 0;
    if (ws_scalars < 0 || ws_scalars > 3) return fprintf(stderr, "SSF_WS_SCALARS: 0..3\n"), 2;
    auto launch_ws_with = [&](auto kernel, auto shape) {
        using Sh = decltype(shape);
        CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Sh::kSharedBytes));
        int sms;
        CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        const int64_t units = (D + Sh::kChannels - 1) / Sh::kChannels * B;
        const unsigned grid = unsigned(std::min<int64_t>(units, int64_t(Sh::kBlocksPerSm) * sms));
        kernel<<<grid, Sh::kThreads, Sh::kSharedBytes>>>(ps);
    };
#define SSF_WS_LAUNCH(SCALARS)                                                                                   \
    launch_ws_with(ws == 2 ? selective_scan_fwd_ws_sm_order_scalars##SCALARS##_bf16 : selective_scan_fwd_ws_scalars##SCALARS##_bf16, \
                   WsShape<SCALARS>{})
    auto launch_ws = [&] {
        if (ws_scalars == 0) SSF_WS_LAUNCH(0);
        else if (ws_scalars == 1) SSF_WS_LAUNCH(1);
        else if (ws_scalars == 2) SSF_WS_LAUNCH(2);
        else SSF_WS_LAUNCH(3);
    };
    // The B/C staging src/ops/selective_scan/cuda.rs picks (tiled_bc_form): 16-byte vectors, but
    // element by element for channel-last below 16 threads per channel; SSF_SCALAR_BC=1 forces that,
    // SSF_VEC_BC=1 vectors for channel-last too.
    const bool scalar_bc = getenv("SSF_SCALAR_BC") || (bld && tpc < 16 && !getenv("SSF_VEC_BC"));
#define SSF_LAUNCH_FORM(PASS, TPC, FORM, CHUNKS)                                                          \
    launch(selective_scan_fwd_##PASS##_bf16_bf16_tpc##TPC##_##FORM, Tiled<TPC>::kChannels, Tiled<TPC>::kThreads, \
           Tile<bf16, TPC>::kSharedBytes, CHUNKS)
#define SSF_LAUNCH_TPC(PASS, TPC, CHUNKS) \
    (scalar_bc ? SSF_LAUNCH_FORM(PASS, TPC, varying, CHUNKS) : SSF_LAUNCH_FORM(PASS, TPC, varying_vec, CHUNKS))
    auto tiled = [&] {
        if (ps.n_chunks > 1) {
            const int64_t chunks = ps.n_chunks - 1;
            if (local_tpc == 2) SSF_LAUNCH_TPC(tiled_local, 2, chunks);
            else if (local_tpc == 4) SSF_LAUNCH_TPC(tiled_local, 4, chunks);
            else if (local_tpc == 8) SSF_LAUNCH_TPC(tiled_local, 8, chunks);
            else if (local_tpc == 16) SSF_LAUNCH_TPC(tiled_local, 16, chunks);
            else SSF_LAUNCH_TPC(tiled_local, 32, chunks);
        }
        if (local_only) return;
        if (ws) return launch_ws();
        if (tpc == 1) SSF_LAUNCH_TPC(tiled, 1, ps.n_chunks);
        else if (tpc == 2) SSF_LAUNCH_TPC(tiled, 2, ps.n_chunks);
        else if (tpc == 4) SSF_LAUNCH_TPC(tiled, 4, ps.n_chunks);
        else if (tpc == 8) SSF_LAUNCH_TPC(tiled, 8, ps.n_chunks);
        else if (tpc == 16) SSF_LAUNCH_TPC(tiled, 16, ps.n_chunks);
        else SSF_LAUNCH_TPC(tiled, 32, ps.n_chunks);
    };
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0)); CHECK(cudaEventCreate(&e1));
    auto time_us = [&](auto f) {
        for (int i = 0; i < 3; ++i) f();
        CHECK(cudaGetLastError());
        CHECK(cudaEventRecord(e0));
        for (int i = 0; i < iters; ++i) f();
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        return ms * 1000.f / iters;
    };
    const float t_lanes = time_us(lanes), t_tiled = time_us(tiled);
    local_only = true;
    const float t_local = ps.n_chunks > 1 ? time_us(tiled) : 0.f;
    local_only = false;
    tiled();  // the output checked below

    std::vector<uint16_t> a(nx), r(nx);
    CHECK(cudaMemcpy(a.data(), out, nx * 2, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(r.data(), out_ref, nx * 2, cudaMemcpyDeviceToHost));
    auto f = [](uint16_t x) { uint32_t w = uint32_t(x) << 16; float v; memcpy(&v, &w, 4); return v; };
    double num = 0, den = 0;
    for (int64_t i = 0; i < nx; ++i) num += (f(a[i]) - f(r[i])) * double(f(a[i]) - f(r[i])), den += f(r[i]) * double(f(r[i]));
    double ck_num = 0, ck_den = 0;
    if (n_ckpt) {
        std::vector<float> ca(n_ckpt), cr(n_ckpt);
        CHECK(cudaMemcpy(ca.data(), p.checkpoints, n_ckpt * 4, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(cr.data(), pr.checkpoints, n_ckpt * 4, cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < n_ckpt; ++i) ck_num += (ca[i] - cr[i]) * double(ca[i] - cr[i]), ck_den += cr[i] * double(cr[i]);
    }
    int dev;
    cudaDeviceProp prop;
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaGetDeviceProperties(&prop, dev));
    // Special-function-unit floor: one ex2 per element at 16 per clock per SM, at 1.755 GHz.
    const double floor_us = double(nx) * N / (prop.multiProcessorCount * 16.0 * 1.755e9) * 1e6;
    printf("ws=%d/%d chunks=%lld ckl=%lld poly=%d group=%d %s B=%lld D=%lld L=%lld N=%lld  tiled %.1f us (first pass %.1f)  lanes %.1f us  exp-floor %.1f us (%.0f%%)  relL2 %.2e%s\n",
           ws, ws_scalars, (long long)ps.n_chunks, (long long)p.checkpoint_len, SSF_POLY_STATES, SSF_STEP_GROUP, bld ? "bld" : "bdl", (long long)B,
           (long long)D, (long long)L, (long long)N, t_tiled, t_local, t_lanes, floor_us, 100.0 * floor_us / t_tiled, sqrt(num / den),
           n_ckpt ? ("  checkpoints relL2 " + std::to_string(sqrt(ck_num / ck_den))).c_str() : "");
    return 0;
}
