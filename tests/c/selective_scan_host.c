/* A C host of the plain C API (include/xla_ssm.h): runs small f32 problems through
 * xla_ssm_selective_scan_fwd_host, checks them against a naive loop written here from
 * docs/selective_scan_fwd.md, checks that bad calls are refused with a message, and prints "c api ok".
 * Built and run by tests/suite/c_api.rs. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xla_ssm.h"

#define BATCH 2
#define DIM 4
#define SEQLEN 9
#define DSTATE 3
#define X_LEN (BATCH * DIM * SEQLEN)
#define BC_MAX (BATCH * DIM * DSTATE * SEQLEN)
#define STATE_LEN (BATCH * DIM * DSTATE)

static int failures = 0;

#define CHECK(cond, ...)                                        \
    do {                                                        \
        if (!(cond)) {                                          \
            fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                       \
            fprintf(stderr, "\n");                              \
            failures++;                                         \
        }                                                       \
    } while (0)

static unsigned rng_state = 12345u;
/* Uniform in [lo, hi). */
static float uniform(float lo, float hi) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return lo + (hi - lo) * (float)(rng_state >> 8) / 16777216.0f;
}

static float u[X_LEN], delta[X_LEN], z[X_LEN], out[X_LEN];
static float A[DIM * DSTATE], Dv[DIM], bias[DIM];
static float Bm[BC_MAX], Cm[BC_MAX];
static float h0[STATE_LEN], final_state[STATE_LEN];
static double want_out[X_LEN], want_state[STATE_LEN];

/* Index of x[b, d, l] in layout bdl (0) or bld (1). */
static int x_at(int layout, int b, int d, int l) {
    return layout == 0 ? (b * DIM + d) * SEQLEN + l : (b * SEQLEN + l) * DIM + d;
}

/* Index of B[b, group of d, n, l]; groups == 0: time-invariant (dim, dstate). */
static int bc_at(int layout, int groups, int b, int d, int n, int l) {
    if (groups == 0) return d * DSTATE + n;
    int g = d / (DIM / groups);
    return layout == 0 ? ((b * groups + g) * DSTATE + n) * SEQLEN + l : ((b * SEQLEN + l) * groups + g) * DSTATE + n;
}

static void reference(int layout, int groups, int softplus) {
    for (int b = 0; b < BATCH; b++) {
        for (int d = 0; d < DIM; d++) {
            double h[DSTATE];
            for (int n = 0; n < DSTATE; n++) h[n] = h0[(b * DIM + d) * DSTATE + n];
            for (int l = 0; l < SEQLEN; l++) {
                int xi = x_at(layout, b, d, l);
                double dt = (double)delta[xi] + bias[d];
                if (softplus) dt = dt > 20.0 ? dt : log1p(exp(dt));
                double y = 0.0;
                for (int n = 0; n < DSTATE; n++) {
                    int bi = bc_at(layout, groups, b, d, n, l);
                    h[n] = exp(dt * A[d * DSTATE + n]) * h[n] + dt * Bm[bi] * u[xi];
                    y += Cm[bi] * h[n];
                }
                y += Dv[d] * u[xi];
                y *= z[xi] / (1.0 + exp(-z[xi]));
                want_out[xi] = y;
            }
            for (int n = 0; n < DSTATE; n++) want_state[(b * DIM + d) * DSTATE + n] = h[n];
        }
    }
}

static XlaSsmSelectiveScanFwdArgs make_args(int layout, int groups, int softplus) {
    XlaSsmSelectiveScanFwdArgs a;
    memset(&a, 0, sizeof a);
    a.batch = BATCH;
    a.dim = DIM;
    a.seqlen = SEQLEN;
    a.dstate = DSTATE;
    a.groups = groups;
    a.dtype = XLA_SSM_F32;
    a.bc_dtype = XLA_SSM_F32;
    a.layout = layout == 0 ? XLA_SSM_LAYOUT_BDL : XLA_SSM_LAYOUT_BLD;
    a.delta_softplus = softplus != 0;
    a.u = u;
    a.delta = delta;
    a.a = A;
    a.b = Bm;
    a.c = Cm;
    a.d = Dv;
    a.z = z;
    a.delta_bias = bias;
    a.initial_state = h0;
    a.out = out;
    a.final_state = final_state;
    return a;
}

static void run_case(int layout, int groups, int softplus) {
    for (int i = 0; i < X_LEN; i++) {
        u[i] = uniform(-2.f, 2.f);
        delta[i] = softplus ? uniform(-4.f, 0.5f) : uniform(0.01f, 1.f);
        z[i] = uniform(-3.f, 3.f);
        out[i] = NAN;
    }
    for (int i = 0; i < DIM * DSTATE; i++) A[i] = -uniform(0.1f, 5.f);
    for (int i = 0; i < BC_MAX; i++) {
        Bm[i] = uniform(-2.f, 2.f);
        Cm[i] = uniform(-2.f, 2.f);
    }
    for (int i = 0; i < DIM; i++) {
        Dv[i] = uniform(-1.f, 1.f);
        bias[i] = uniform(-0.3f, 0.3f);
    }
    for (int i = 0; i < STATE_LEN; i++) {
        h0[i] = uniform(-1.f, 1.f);
        final_state[i] = NAN;
    }
    XlaSsmSelectiveScanFwdArgs a = make_args(layout, groups, softplus);
    XlaSsmStatus st = xla_ssm_selective_scan_fwd_host(&a);
    CHECK(st == XLA_SSM_OK, "layout %d groups %d: status %d: %s", layout, groups, (int)st, xla_ssm_last_error());
    CHECK(strcmp(xla_ssm_last_error(), "") == 0, "last error after success: \"%s\"", xla_ssm_last_error());
    reference(layout, groups, softplus);
    double max_ref = 0, max_err = 0;
    for (int i = 0; i < X_LEN; i++) {
        CHECK(!isnan(out[i]), "layout %d groups %d: out[%d] not written", layout, groups, i);
        if (fabs(want_out[i]) > max_ref) max_ref = fabs(want_out[i]);
        if (fabs(out[i] - want_out[i]) > max_err) max_err = fabs(out[i] - want_out[i]);
    }
    CHECK(max_err <= 1e-5 * max_ref, "layout %d groups %d: out error %g (max |ref| %g)", layout, groups, max_err, max_ref);
    max_ref = 0, max_err = 0;
    for (int i = 0; i < STATE_LEN; i++) {
        if (fabs(want_state[i]) > max_ref) max_ref = fabs(want_state[i]);
        if (!(fabs(final_state[i] - want_state[i]) <= max_err)) max_err = fabs(final_state[i] - want_state[i]);
    }
    CHECK(max_err <= 1e-5 * max_ref, "layout %d groups %d: state error %g (max |ref| %g)", layout, groups, max_err, max_ref);
}

static void expect_invalid(const XlaSsmSelectiveScanFwdArgs* a, const char* needle, const char* what) {
    XlaSsmStatus st = xla_ssm_selective_scan_fwd_host(a);
    const char* msg = xla_ssm_last_error();
    CHECK(st == XLA_SSM_INVALID_ARGUMENT, "%s: status %d, want XLA_SSM_INVALID_ARGUMENT (%s)", what, (int)st, msg);
    CHECK(msg != NULL && strstr(msg, needle) != NULL, "%s: message \"%s\" lacks \"%s\"", what, msg ? msg : "(null)", needle);
}

int main(void) {
    printf("xla_ssm %s, %d CUDA device(s)\n", xla_ssm_version(), (int)xla_ssm_cuda_device_count());
    CHECK(xla_ssm_cuda_device_count() >= 0, "device count");
    CHECK(XLA_SSM_MAX_DSTATE == 256, "XLA_SSM_MAX_DSTATE");

    run_case(0, 2, 1);  /* bdl, 2 groups, softplus */
    run_case(1, 1, 0);  /* bld, 1 group, no softplus */
    run_case(1, 0, 1);  /* bld, time-invariant B/C */
    run_case(0, 4, 1);  /* bdl, one group per channel */

    XlaSsmSelectiveScanFwdArgs a = make_args(0, 2, 1);
    for (int i = 0; i < X_LEN; i++) out[i] = NAN;
    a.dtype = 7;
    expect_invalid(&a, "dtype code 7", "dtype 7");
    a = make_args(0, 2, 1);
    a.bc_dtype = -1;
    expect_invalid(&a, "bc_dtype", "bc_dtype -1");
    a = make_args(0, 2, 1);
    a.layout = 2;
    expect_invalid(&a, "layout", "layout 2");
    a = make_args(0, 3, 1);
    expect_invalid(&a, "groups", "groups 3 with dim 4");
    a = make_args(0, 2, 1);
    a.dstate = XLA_SSM_MAX_DSTATE + 1;
    expect_invalid(&a, "257", "dstate 257");
    a = make_args(0, 2, 1);
    a.u = NULL;
    expect_invalid(&a, "`u`", "u NULL");
    a = make_args(0, 2, 1);
    a.final_state = NULL;
    expect_invalid(&a, "final_state", "final_state NULL");
    expect_invalid(NULL, "NULL", "args NULL");
    for (int i = 0; i < X_LEN; i++) CHECK(isnan(out[i]), "a refused call wrote out[%d]", i);

    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("c api ok\n");
    return 0;
}
