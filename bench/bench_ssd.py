"""Benchmark of Mamba-2's SSD scan: xla_ssm.ssd forward and forward + backward (jax.jit(jax.grad) of a
weighted sum of y over all inputs) against the lax.scan reference xla_ssm.ssd_ref.

    PYTHONPATH=bindings/python XLA_SSM_LIBRARY=target/release/libxla_ssm.so \
        python bench/bench_ssd.py --device cpu|gpu [--quick]

Inputs as in the issue's benchmark: D per head, dt_bias, softplus (--all-options adds z and
initial_states, which sends the CUDA backward down the generic path), one group, chunk 256,
Mamba-2-like magnitudes. Outputs and gradients are checked against the reference (relative L2; the
exit status is 1 when one disagrees). GPU: bf16, batch 2 x seqlen 1000 x 8 heads x headdim 64 x
dstate 128, and the issue's shapes 8 x 2048 x 64 x 64 x 128 and 1 x 16384 x 64 x 64 x 128 (their
reference gradients would keep every step's state, 32 GB: not run); CPU: f32 and bf16 at
1 x 512 x 4 x 32 x 16. --quick: the first.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "gpu"), required=True)
    p.add_argument("--quick", action="store_true", help="only the first shape (and dtype)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-baselines", action="store_true", help="time only our implementation")
    p.add_argument("--all-options", action="store_true", help="also z and initial_states")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    return p.parse_args(argv)


ARGS = parse_args()
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
if ARGS.device == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
else:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import bench_selective_scan as fb  # noqa: E402  (timing, tables and result files)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import xla_ssm  # noqa: E402

# (batch, seqlen, heads, headdim, dstate), and whether the reference gradient fits in memory.
GPU_CASES = [((2, 1000, 8, 64, 128), True), ((8, 2048, 64, 64, 128), False), ((1, 16384, 64, 64, 128), False)]
CPU_CASES = [((1, 512, 4, 32, 16), True)]
# Mamba-2's Triton kernels on the H100 (the issue), bf16: forward, and forward + backward.
TRITON_FWD_US = {(8, 2048, 64, 64, 128): 1000.0, (1, 16384, 64, 64, 128): 841.0}
TRITON_GRAD_US = {(8, 2048, 64, 64, 128): 4925.0, (1, 16384, 64, 64, 128): 3498.0}
TOL = {"float32": 1e-4, "bfloat16": 3e-2}
NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
STATIC = dict(chunk_size=256, dt_softplus=True)


def make_inputs(shape, dtype, seed=0):
    """A = -(1..heads)/heads-ish (Mamba-2 initialises A in [1, 16]), dt_bias = softplus^-1 of dt in
    [1e-3, 1e-1] log-uniformly, everything else normal."""
    b, l, h, p, n = shape
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)

    @jax.jit
    def gen():
        normal = lambda k, s: jax.random.normal(k, s, jnp.float32)  # noqa: E731
        dt0 = jnp.exp(jax.random.uniform(ks[0], (h,), jnp.float32, math.log(1e-3), math.log(1e-1)))
        return dict(
            x=normal(ks[1], (b, l, h, p)).astype(dtype),
            dt=(0.5 * normal(ks[2], (b, l, h))).astype(dtype),
            A=-jax.random.uniform(ks[3], (h,), jnp.float32, 1.0, 16.0),
            B=normal(ks[4], (b, l, 1, n)).astype(dtype),
            C=normal(ks[5], (b, l, 1, n)).astype(dtype),
            D=jnp.ones((h,), jnp.float32),
            z=normal(ks[6], (b, l, h, p)).astype(dtype),
            dt_bias=dt0 + jnp.log(-jnp.expm1(-dt0)),
            initial_states=normal(ks[7], (b, h, p, n)),
        )

    x = gen()
    jax.block_until_ready(x)
    optional = () if ARGS.all_options else ("z", "initial_states")
    return tuple(None if k in optional else x[k] for k in NAMES)


def call(scan):
    def f(*args):
        return scan(*args[:5], D=args[5], z=args[6], dt_bias=args[7], initial_states=args[8], **STATIC)

    return f


def grad_fn(scan):
    def loss(args, w):
        return jnp.sum(call(scan)(*args).astype(jnp.float32) * w)

    return jax.jit(jax.grad(loss))


def vjp_fn(scan):
    """Forward and backward as a training step runs them: y, then every gradient from a cotangent dy
    in y's dtype. (jax.grad of sum(y * w) also spends a convert of the f32 w into dy: 125 us at
    8x2048x64x64 on an H100, not the op's work.)"""

    def step(args, dy):
        y, pull = jax.vjp(lambda a: call(scan)(*a), args)
        return y, pull(dy)

    return jax.jit(step)


def run_case(shape, ref_grad_fits, dtype, records):
    args = make_inputs(shape, dtype)
    w = jax.random.normal(jax.random.PRNGKey(1), args[0].shape, jnp.float32).astype(dtype).astype(jnp.float32)
    target = 0.05 if ARGS.device == "gpu" else 0.5
    dname = jnp.dtype(dtype).name
    name = f"{'x'.join(map(str, shape))} {dname}"
    rec = {"shape": shape, "dtype": dname, "chunk_size": STATIC["chunk_size"]}
    fwd = jax.jit(call(xla_ssm.ssd))
    rec["fwd_s"], _ = fb.time_adaptive(fwd, args, reps=ARGS.reps, target_s=target)
    g_ours = grad_fn(xla_ssm.ssd)
    rec["grad_s"], _ = fb.time_adaptive(g_ours, (args, w), reps=ARGS.reps, target_s=target)
    rec["vjp_s"], _ = fb.time_adaptive(vjp_fn(xla_ssm.ssd), (args, w.astype(dtype)), reps=ARGS.reps, target_s=target)

    # Correctness against the lax.scan reference (in f32 on the same inputs).
    ref_fwd = jax.jit(call(xla_ssm.ssd_ref))
    err = fb.rel_l2_device(fwd(*args), ref_fwd(*args))
    rec["y_rel_l2"] = err
    if not err <= TOL[dname]:
        fb.FAILURES.append(f"{name}: y rel L2 {err:.2e}")
    msg = f"{name}: y vs lax.scan reference, rel L2 {err:.1e}"
    if ref_grad_fits:
        got, want = g_ours(args, w), grad_fn(xla_ssm.ssd_ref)(args, w)
        errs = {k: fb.rel_l2_device(g, r) for k, g, r in zip(NAMES, got, want) if g is not None}
        rec["worst_grad_rel_l2"] = max(errs.values())
        if not rec["worst_grad_rel_l2"] <= TOL[dname]:
            fb.FAILURES.append(f"{name}: gradient rel L2 {errs}")
        msg += "; gradients: " + ", ".join(f"{k} {e:.1e}" for k, e in errs.items())
        del got, want
    fb.log(msg)

    if not ARGS.no_baselines:
        rec["ref_fwd_s"] = fb.attempt(f"{name} lax.scan fwd", lambda: fb.time_adaptive(ref_fwd, args, reps=3, target_s=target)[0])
        if ref_grad_fits:
            g_ref = grad_fn(xla_ssm.ssd_ref)
            rec["ref_grad_s"] = fb.attempt(f"{name} lax.scan grad", lambda: fb.time_adaptive(g_ref, (args, w), reps=3, target_s=target)[0])
    records.append(rec)


def report(records):
    headers = ["shape (b x l x h x p x n)", "dtype", "fwd", "fwd+bwd", "grad", "lax.scan fwd", "vs", "lax.scan grad", "vs"]
    if ARGS.device == "gpu":
        headers += ["Triton fwd", "vs", "Triton fwd+bwd", "vs"]
    rows = []
    for r in records:
        row = [
            "x".join(map(str, r["shape"])), r["dtype"], fb.fmt_us(r["fwd_s"]), fb.fmt_us(r["vjp_s"]), fb.fmt_us(r["grad_s"]),
            fb.fmt_us(r.get("ref_fwd_s")), fb.fmt_x(fb.ratio(r.get("ref_fwd_s"), r["fwd_s"])),
            fb.fmt_us(r.get("ref_grad_s")), fb.fmt_x(fb.ratio(r.get("ref_grad_s"), r["grad_s"])),
        ]  # fmt: skip
        if ARGS.device == "gpu":
            for table, ours in ((TRITON_FWD_US, r["fwd_s"]), (TRITON_GRAD_US, r["vjp_s"])):
                triton = table.get(tuple(r["shape"]))
                row += [fb.fmt_us(triton and triton * 1e-6), fb.fmt_x(fb.ratio(triton and triton * 1e-6, ours))]
        rows.append(row)
    fb.log(
        f"\ntimes in us (median of jitted calls); chunk_size {STATIC['chunk_size']}; vs: reference time / ours; "
        "fwd+bwd: jax.vjp with a cotangent in y's dtype; grad: jax.grad of sum(y * w) with an f32 w"
    )
    fb.print_table(headers, rows)


def main():
    xla_ssm.load()
    fb.log(f"xla_ssm SSD benchmark: jax {jax.__version__} on {jax.devices()[0]}")
    records = []
    if ARGS.device == "gpu":
        cases = [(s, fits, jnp.bfloat16) for s, fits in GPU_CASES]
    else:
        cases = [(s, fits, dt) for s, fits in CPU_CASES for dt in (jnp.float32, jnp.bfloat16)]
    for shape, fits, dtype in cases[: 1 if ARGS.quick else None]:
        run_case(shape, fits, dtype, records)
    report(records)
    meta = fb.base_meta()
    meta["triton_fwd_us"] = {"x".join(map(str, k)): v for k, v in TRITON_FWD_US.items()}
    meta["triton_grad_us"] = {"x".join(map(str, k)): v for k, v in TRITON_GRAD_US.items()}
    meta["options"] = "D, dt_bias, softplus" + (", z, initial_states" if ARGS.all_options else "")
    fb.write_results(ARGS.out, meta, records, f"ssd_{ARGS.device}")
    if fb.FAILURES:
        fb.log("MISMATCHES / FAILURES:\n  " + "\n  ".join(fb.FAILURES))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
