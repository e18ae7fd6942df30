"""Benchmark of Mamba-2's SSD scan: xla_ssm.ssd forward and forward + backward against the lax.scan
reference xla_ssm.ssd_ref and, with --triton, Mamba-2's official Triton kernels in the same run.

    PYTHONPATH=bindings/python XLA_SSM_LIBRARY=target/release/libxla_ssm.so \
        python bench/bench_ssd.py --device cpu|gpu [--quick] [--sweep] [--triton DIR]

Inputs as in the issue's benchmark: D per head, dt_bias, softplus (--all-options adds z and
initial_states to every case), one group, chunk 256, Mamba-2-like magnitudes. Outputs (and, where the
reference's gradients fit in memory, gradients) are checked against the reference (relative L2; the
exit status is 1 when one disagrees). GPU: bf16, batch 2 x seqlen 1000 x 8 heads x headdim 64 x
dstate 128, and the issue's shapes 8 x 2048 x 64 x 64 x 128 and 1 x 16384 x 64 x 64 x 128; --sweep
adds variants of 8 x 2048 (f32; headdim 32 and 128 at the same 4096 channels, the latter also at
1 x 16384; dstate 16, and 256 also at 1 x 16384; chunks of 64 and 128; z); --case NAME picks cases by name. CPU: f32
and bf16 at 1 x 512 x 4 x 32 x 16. --quick: the first case.

--triton DIR: DIR holds the `mamba_ssm` package's source (e.g. the PyPI sdist unpacked); its
`mamba_chunk_scan_combined` runs through PyTorch on the same inputs (the package's __init__, which
needs the compiled extension, is not run), timed the same way, and its y is compared with ours.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "gpu"), required=True)
    p.add_argument("--quick", action="store_true", help="only the first case")
    p.add_argument("--sweep", action="store_true", help="GPU: also the variants of the main shape")
    p.add_argument("--case", action="append", default=[], help="GPU: only these cases (names as printed; repeatable)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-baselines", action="store_true", help="no lax.scan timings")
    p.add_argument("--all-options", action="store_true", help="z and initial_states in every case")
    p.add_argument("--triton", type=Path, help="a directory holding mamba_ssm's source: time its Triton kernels too")
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


@dataclass(frozen=True)
class Case:
    shape: tuple  # (batch, seqlen, heads, headdim, dstate)
    dtype: str = "bfloat16"
    chunk_size: int = 256
    z: bool = False
    ref_grad_fits: bool = False  # the lax.scan reference's gradient keeps every step's state

    @property
    def name(self):
        extra = ([] if self.chunk_size == 256 else [f"chunk {self.chunk_size}"]) + (["z"] if self.z else [])
        return " ".join(["x".join(map(str, self.shape)), self.dtype, *extra])


MAIN = (8, 2048, 64, 64, 128)
GPU_CASES = [Case((2, 1000, 8, 64, 128), ref_grad_fits=True), Case(MAIN), Case((1, 16384, 64, 64, 128))]
# Issue 51's other shapes: the main one with one thing changed (headdim at the same 4096 channels).
SWEEP = [
    Case(MAIN, "float32"),
    Case((8, 2048, 128, 32, 128)),
    Case((8, 2048, 32, 128, 128)),
    Case((1, 16384, 32, 128, 128)),
    Case((8, 2048, 64, 64, 16)),
    Case((8, 2048, 64, 64, 256)),
    Case((1, 16384, 64, 64, 256)),
    Case(MAIN, chunk_size=64),
    Case(MAIN, chunk_size=128),
    Case(MAIN, z=True),
]
CPU_CASES = [Case((1, 512, 4, 32, 16), dt, ref_grad_fits=True) for dt in ("float32", "bfloat16")]
TOL = {"float32": 1e-4, "bfloat16": 3e-2}
NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def make_inputs(case: Case, seed=0):
    """A = -(1..heads)/heads-ish (Mamba-2 initialises A in [1, 16]), dt_bias = softplus^-1 of dt in
    [1e-3, 1e-1] log-uniformly, everything else normal."""
    b, l, h, p, n = case.shape
    dtype = jnp.dtype(case.dtype)
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
    absent = set() if ARGS.all_options else {"initial_states"} | (set() if case.z else {"z"})
    return tuple(None if k in absent else x[k] for k in NAMES)


def call(scan, case: Case):
    def f(*args):
        return scan(*args[:5], D=args[5], z=args[6], dt_bias=args[7], initial_states=args[8], chunk_size=case.chunk_size, dt_softplus=True)

    return f


def grad_fn(scan, case):
    def loss(args, w):
        return jnp.sum(call(scan, case)(*args).astype(jnp.float32) * w)

    return jax.jit(jax.grad(loss))


def vjp_fn(scan, case):
    """Forward and backward as a training step runs them: y, then every gradient from a cotangent dy
    in y's dtype. (jax.grad of sum(y * w) also spends a convert of the f32 w into dy: 125 us at
    8x2048x64x64 on an H100, not the op's work.)"""

    def step(args, dy):
        y, pull = jax.vjp(lambda a: call(scan, case)(*a), args)
        return y, pull(dy)

    return jax.jit(step)


# ------------------------------------------------------------------------------------ Triton
def load_triton(src: Path):
    """mamba_chunk_scan_combined from the mamba_ssm source at `src`, without running the package's
    __init__ (it imports the compiled selective-scan extension)."""
    root = src / "mamba_ssm" if (src / "mamba_ssm").is_dir() else src
    if not (root / "ops" / "triton" / "ssd_combined.py").is_file():
        raise FileNotFoundError(f"--triton {src}: no mamba_ssm/ops/triton/ssd_combined.py there")
    pkg = types.ModuleType("mamba_ssm")
    pkg.__path__ = [str(root)]
    sys.modules["mamba_ssm"] = pkg
    return importlib.import_module("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined


def time_torch(fn, *, reps, target_s, max_inner=200):
    """As fb.time_adaptive for PyTorch: after a warm-up that compiles the kernels, the calls per
    repetition that take about `target_s`, timed by fb.torch_time (CUDA events)."""
    import torch

    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    inner = int(min(max_inner, max(1, target_s / max(time.perf_counter() - t, 1e-6))))
    return fb.torch_time(torch, fn, reps=reps, inner=inner, warmup=0)


def run_triton(scan, case, args, dy, y_ours, rec, target):
    """Triton's forward (no autograd) and forward + backward (every gradient from dy) on our inputs."""
    import torch

    t = {k: (None if a is None else torch.from_dlpack(a).clone()) for k, a in zip(NAMES, args)}
    kw = dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"], initial_states=t["initial_states"], dt_softplus=True)
    pos = [t[k] for k in ("x", "dt", "A", "B", "C")]

    def fwd():
        with torch.no_grad():
            return scan(*pos, case.chunk_size, **kw)

    rec["triton_y_rel_l2"] = fb.rel_l2_device(y_ours, jnp.from_dlpack(fwd().contiguous()))
    rec["triton_fwd_s"] = time_torch(fwd, reps=ARGS.reps, target_s=target)
    leaves = {k: v.requires_grad_(True) for k, v in t.items() if v is not None}
    grad_pos = [leaves[k] for k in ("x", "dt", "A", "B", "C")]
    grad_kw = dict(kw, **{k: leaves.get(k) for k in ("D", "z", "dt_bias", "initial_states")})
    dy_t = torch.from_dlpack(dy).clone()

    def train():
        y = scan(*grad_pos, case.chunk_size, **grad_kw)
        return torch.autograd.grad(y, list(leaves.values()), dy_t)

    rec["triton_vjp_s"] = time_torch(train, reps=ARGS.reps, target_s=target)


# ------------------------------------------------------------------------------------ a case
def run_case(case: Case, records, triton):
    args = make_inputs(case)
    dtype = jnp.dtype(case.dtype)
    w = jax.random.normal(jax.random.PRNGKey(1), args[0].shape, jnp.float32).astype(dtype).astype(jnp.float32)
    target = 0.05 if ARGS.device == "gpu" else 0.5
    rec = {"case": case.name, "shape": case.shape, "dtype": case.dtype, "chunk_size": case.chunk_size, "z": case.z}
    fwd = jax.jit(call(xla_ssm.ssd, case))
    rec["fwd_s"], _ = fb.time_adaptive(fwd, args, reps=ARGS.reps, target_s=target)
    g_ours = grad_fn(xla_ssm.ssd, case)
    rec["grad_s"], _ = fb.time_adaptive(g_ours, (args, w), reps=ARGS.reps, target_s=target)
    rec["vjp_s"], _ = fb.time_adaptive(vjp_fn(xla_ssm.ssd, case), (args, w.astype(dtype)), reps=ARGS.reps, target_s=target)

    # Correctness against the lax.scan reference (in f32 on the same inputs).
    ref_fwd = jax.jit(call(xla_ssm.ssd_ref, case))
    y = fwd(*args)
    err = fb.rel_l2_device(y, ref_fwd(*args))
    rec["y_rel_l2"] = err
    if not err <= TOL[case.dtype]:
        fb.FAILURES.append(f"{case.name}: y rel L2 {err:.2e}")
    msg = f"{case.name}: y vs lax.scan reference, rel L2 {err:.1e}"
    if case.ref_grad_fits:
        got, want = g_ours(args, w), grad_fn(xla_ssm.ssd_ref, case)(args, w)
        errs = {k: fb.rel_l2_device(g, r) for k, g, r in zip(NAMES, got, want) if g is not None}
        rec["worst_grad_rel_l2"] = max(errs.values())
        if not rec["worst_grad_rel_l2"] <= TOL[case.dtype]:
            fb.FAILURES.append(f"{case.name}: gradient rel L2 {errs}")
        msg += "; gradients: " + ", ".join(f"{k} {e:.1e}" for k, e in errs.items())
        del got, want
    fb.log(msg)

    if triton is not None:
        fb.attempt(f"{case.name} Triton", run_triton, triton, case, args, w.astype(dtype), y, rec, target)
        if "triton_y_rel_l2" in rec:
            fb.log(f"{case.name}: y vs Triton's, rel L2 {rec['triton_y_rel_l2']:.1e}")
    if not ARGS.no_baselines:
        rec["ref_fwd_s"] = fb.attempt(f"{case.name} lax.scan fwd", lambda: fb.time_adaptive(ref_fwd, args, reps=3, target_s=target)[0])
        if case.ref_grad_fits:
            g_ref = grad_fn(xla_ssm.ssd_ref, case)
            rec["ref_grad_s"] = fb.attempt(f"{case.name} lax.scan grad", lambda: fb.time_adaptive(g_ref, (args, w), reps=3, target_s=target)[0])
    records.append(rec)
    fb.log(
        f"{case.name}: fwd {fb.fmt_us(rec['fwd_s'])} us, fwd+bwd {fb.fmt_us(rec['vjp_s'])} us; Triton "
        f"{fb.fmt_us(rec.get('triton_fwd_s'))} / {fb.fmt_us(rec.get('triton_vjp_s'))} us"
    )


def report(records):
    headers = ["case (b x l x h x p x n)", "fwd", "fwd+bwd", "grad", "lax.scan fwd", "vs", "lax.scan grad", "vs"]
    headers += ["Triton fwd", "vs", "Triton fwd+bwd", "vs"]
    rows = []
    for r in records:
        row = [r["case"], fb.fmt_us(r["fwd_s"]), fb.fmt_us(r["vjp_s"]), fb.fmt_us(r["grad_s"])]
        for ref, ours in (("ref_fwd_s", "fwd_s"), ("ref_grad_s", "grad_s"), ("triton_fwd_s", "fwd_s"), ("triton_vjp_s", "vjp_s")):
            row += [fb.fmt_us(r.get(ref)), fb.fmt_x(fb.ratio(r.get(ref), r[ours]))]
        rows.append(row)
    fb.log(
        "\ntimes in us (median of back-to-back calls); vs: their time / ours; fwd+bwd: jax.vjp (Triton: "
        "torch.autograd.grad) with a cotangent in y's dtype; grad: jax.grad of sum(y * w) with an f32 w"
    )
    fb.print_table(headers, rows)


def main():
    xla_ssm.load()
    fb.log(f"xla_ssm SSD benchmark: jax {jax.__version__} on {jax.devices()[0]}")
    triton = load_triton(ARGS.triton) if ARGS.triton else None
    if ARGS.device == "gpu":
        cases = GPU_CASES + (SWEEP if ARGS.sweep or ARGS.case else [])
        if ARGS.case:
            unknown = set(ARGS.case) - {c.name for c in cases}
            if unknown:
                fb.log(f"unknown --case {sorted(unknown)}; the cases: {[c.name for c in cases]}")
                return 2
            cases = [c for c in cases if c.name in ARGS.case]
    else:
        cases = CPU_CASES
    records = []
    for case in cases[: 1 if ARGS.quick else None]:
        run_case(case, records, triton)
    report(records)
    meta = fb.base_meta()
    meta["options"] = "D, dt_bias, softplus" + (", z, initial_states" if ARGS.all_options else "")
    meta["triton"] = str(ARGS.triton) if ARGS.triton else None
    fb.write_results(ARGS.out, meta, records, f"ssd_{ARGS.device}")
    if fb.FAILURES:
        fb.log("MISMATCHES / FAILURES:\n  " + "\n  ".join(fb.FAILURES))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
