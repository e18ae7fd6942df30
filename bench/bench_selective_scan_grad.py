"""Benchmark of the selective scan's gradient (xla_ssm.selective_scan under jax.grad) against jax.grad
of the lax.associative_scan and lax.scan references.

    PYTHONPATH=bindings/python XLA_SSM_LIBRARY=target/release/libxla_ssm.so \
        python bench/bench_selective_scan_grad.py --device cpu|gpu [--quick] [--checkpoint-len 32|64]

Per shape: our forward alone (no checkpoints, the inference path), our forward with checkpoints, our
forward + backward (jax.jit(jax.grad) of a weighted sum of the output over all eight inputs), the
backward as the difference of the two, and the same gradient through the references. Also "vjp":
jax.vjp of the op with a cotangent of the output's dtype given (forward with checkpoints, then every
gradient), the way the official kernel's backward is timed; jax.grad also spends an XLA convert of
the f32 weights into that cotangent. Every gradient
is checked against the lax.scan reference's (relative L2 per input). The exit status is 1 when one
disagrees. GPU: bf16, the issue's shape (batch 8, dim 4096, seqlen 2048, dstate 16) in both layouts,
batch 1, dim 1536, and batch 1, seqlen 16384 (sequence splits); CPU: f32 and bf16 at batch 2, dim 256, seqlen 512.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "gpu"), required=True)
    p.add_argument("--quick", action="store_true", help="only the first shape")
    p.add_argument("--checkpoint-len", type=int, default=None, help="the forward's checkpoint interval")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-baselines", action="store_true", help="time only our implementation")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    return p.parse_args(argv)


ARGS = parse_args()
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
if ARGS.device == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
else:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import bench_selective_scan as fb  # noqa: E402  (shares inputs, references, timing and tables)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import xla_ssm  # noqa: E402
from xla_ssm import _scan  # noqa: E402

# The official Mamba CUDA kernels on the H100 (the figures, bf16, 8 x 4096 x 2048 x 16).
OFFICIAL_US = {"fwd": 1168.0, "bwd": 4812.0}
GPU_CASES = [
    ((8, 4096, 2048, 16), "bdl"),
    ((8, 4096, 2048, 16), "bld"),
    ((1, 1536, 2048, 16), "bdl"),
    ((1, 4096, 16384, 16), "bdl"),
]
CPU_CASES = [((2, 256, 512, 16), "bdl")]
TOL = {"float32": 1e-4, "bfloat16": 3e-2}
NAMES = fb.ORDER


def ours(u, delta, A, B, C, D, z, delta_bias, *, layout):
    return xla_ssm.selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=True, layout=layout)


def grad_fn(scan, layout):
    def loss(args, w):
        out = scan(*args, layout=layout)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(out.astype(jnp.float32) * w)

    return jax.jit(jax.grad(loss))


def run_case(shape, layout, dtype, records):
    b, d, l, n = shape
    x = fb.make_inputs(b, d, l, n, dtype, layout)
    args = fb.args_of(x)
    w = jax.random.normal(jax.random.PRNGKey(1), x["u"].shape, jnp.float32).astype(dtype).astype(jnp.float32)
    target = 0.05 if ARGS.device == "gpu" else 0.5
    name = f"{b}x{d}x{l}x{n} {layout} {jnp.dtype(dtype).name}"
    rec = {"shape": shape, "layout": layout, "dtype": jnp.dtype(dtype).name, "checkpoint_len": _scan.CHECKPOINT_LEN}

    fwd = jax.jit(lambda *a: ours(*a, layout=layout))
    rec["fwd_s"], _ = fb.time_adaptive(fwd, args, reps=ARGS.reps, target_s=target)
    # The forward rule of the custom_vjp: out and the checkpoints (one custom call).
    fwd_ckpt = jax.jit(lambda *a: jax.vjp(lambda *p: ours(*p, layout=layout), *a)[0])
    rec["fwd_ckpt_s"], _ = fb.time_adaptive(fwd_ckpt, args, reps=ARGS.reps, target_s=target)
    g_ours = grad_fn(ours, layout)
    rec["grad_s"], _ = fb.time_adaptive(g_ours, (args, w), reps=ARGS.reps, target_s=target)
    rec["bwd_s"] = rec["grad_s"] - rec["fwd_ckpt_s"]
    vjp = jax.jit(lambda a, dy: jax.vjp(lambda *p: ours(*p, layout=layout), *a)[1](dy))
    rec["vjp_s"], _ = fb.time_adaptive(vjp, (args, w.astype(dtype)), reps=ARGS.reps, target_s=target)
    rec["bwd_vjp_s"] = rec["vjp_s"] - rec["fwd_ckpt_s"]

    # Correctness: every input's gradient against jax.grad of the lax.scan reference.
    ref = grad_fn(fb.ref_lax_scan, layout)(args, w)
    got = g_ours(args, w)
    errs = {k: fb.rel_l2_device(g, r) for k, g, r in zip(NAMES, got, ref)}
    worst = max(errs.values())
    rec["worst_rel_l2"] = worst
    if not worst <= TOL[jnp.dtype(dtype).name]:
        fb.FAILURES.append(f"{name}: gradient rel L2 {errs}")
    fb.log(f"{name}: gradients vs lax.scan reference, rel L2: " + ", ".join(f"{k} {e:.1e}" for k, e in errs.items()))
    del ref, got

    if not ARGS.no_baselines:
        for label, scan in (("assoc", fb.ref_associative_scan), ("lax_scan", fb.ref_lax_scan)):
            rec[f"{label}_grad_s"] = fb.attempt(
                f"{name} {label}", lambda s=scan: fb.time_adaptive(grad_fn(s, layout), (args, w), reps=3, target_s=target)[0]
            )
    records.append(rec)


def report(records):
    headers = ["shape", "layout", "dtype", "fwd", "fwd+ckpt", "fwd+bwd", "bwd", "vjp", "bwd (vjp)", "assoc grad", "vs assoc"]
    headers += ["lax.scan grad", "vs lax.scan"]
    if ARGS.device == "gpu":
        headers += ["bwd vs official"]
    rows = []
    for r in records:
        row = [
            "x".join(map(str, r["shape"])), r["layout"], r["dtype"], fb.fmt_us(r["fwd_s"]), fb.fmt_us(r["fwd_ckpt_s"]),
            fb.fmt_us(r["grad_s"]), fb.fmt_us(r["bwd_s"]), fb.fmt_us(r["vjp_s"]), fb.fmt_us(r["bwd_vjp_s"]),
            fb.fmt_us(r.get("assoc_grad_s")),
            fb.fmt_x(fb.ratio(r.get("assoc_grad_s"), r["grad_s"])), fb.fmt_us(r.get("lax_scan_grad_s")),
            fb.fmt_x(fb.ratio(r.get("lax_scan_grad_s"), r["grad_s"])),
        ]
        if ARGS.device == "gpu":
            main_shape = r["shape"] == (8, 4096, 2048, 16)
            row.append(fb.fmt_x(fb.ratio(OFFICIAL_US["bwd"] * 1e-6, r["bwd_vjp_s"])) if main_shape else "-")
        rows.append(row)
    fb.log(
        f"\ntimes in us (median); checkpoint_len {_scan.CHECKPOINT_LEN}; official Mamba bwd (H100): "
        f"{OFFICIAL_US['bwd']:.0f} us, against bwd (vjp)"
    )
    fb.print_table(headers, rows)


def main():
    if ARGS.checkpoint_len:
        _scan.CHECKPOINT_LEN = ARGS.checkpoint_len
    xla_ssm.load()
    fb.log(f"xla_ssm gradient benchmark: jax {jax.__version__} on {jax.devices()[0]}")
    records = []
    if ARGS.device == "gpu":
        cases = [(s, lay, jnp.bfloat16) for s, lay in GPU_CASES]
    else:
        cases = [(s, lay, dt) for s, lay in CPU_CASES for dt in (jnp.float32, jnp.bfloat16)]
    for shape, layout, dtype in cases[: 1 if ARGS.quick else None]:
        run_case(shape, layout, dtype, records)
    report(records)
    meta = fb.base_meta()
    meta["official_us"] = OFFICIAL_US
    fb.write_results(ARGS.out, meta, records, f"grad_{ARGS.device}")
    if fb.FAILURES:
        fb.log("MISMATCHES / FAILURES:\n  " + "\n  ".join(fb.FAILURES))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
