"""Benchmark of the forward selective scan (libxla_ssm) against JAX and PyTorch baselines.

    PYTHONPATH=bindings/python XLA_SSM_LIBRARY=target/release/libxla_ssm.so \
        python bench/bench_selective_scan.py --device cpu|gpu [--quick] [--out bench/results]

--device cpu  our CPU target through jax.jit against jitted jax.lax.scan and jax.lax.associative_scan
              references on the CPU, f32 and bf16, shapes for a small machine.
--device gpu  our CUDA target through jax.jit and through the C API (ctypes on PyTorch tensors, timed
              with CUDA events), against jitted lax.associative_scan / lax.scan and a PyTorch eager
              loop; the issue's shapes in both layouts plus a batch sweep; the fractions of the
              exp-unit and HBM limits; JSON, CSV, a PNG plot and Chrome traces in --out.

Every implementation's output is checked once per case against a reference; the exit status is 1
when one disagrees (and 2 when nothing could run). Optional pieces (PyTorch, matplotlib, profilers,
baselines too big for memory or the time budget) are skipped with a message, never fatally.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import datetime
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "gpu"), required=True)
    p.add_argument("--quick", action="store_true", help="only the main shape (GPU: bdl and bld; CPU: f32 and bf16)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="folder for JSON/CSV/plot/traces")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per implementation (median reported)")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="wall-clock budget: past it, optional baselines are skipped (default 330)")
    p.add_argument("--no-baselines", action="store_true", help="time only our implementation")
    p.add_argument("--no-sweep", action="store_true", help="GPU: skip the batch sweep")
    p.add_argument("--dstate", type=int, default=16,
                   help="GPU: the shapes (and sweep) at this dstate; the official kernel's figures are for 16")
    p.add_argument("--dry-run", action="store_true",
                   help="GPU mode's code path on whatever device jax has, with tiny shapes (tests the harness)")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None

# Environment that must be set before jax/numpy are imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # OpenBLAS threads spin and steal the 2 cores
if ARGS is not None and ARGS.device == "cpu" and not ARGS.dry_run:
    os.environ["JAX_PLATFORMS"] = "cpu"
else:
    # JAX would otherwise take 75% of the GPU up front and leave PyTorch nothing.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

try:
    import xla_ssm  # noqa: E402
except ImportError:
    sys.path.insert(0, str(ROOT / "bindings" / "python"))
    import xla_ssm  # noqa: E402

T0 = time.perf_counter()
FAILURES: list[str] = []


def log(msg=""):
    print(msg, flush=True)


def elapsed():
    return time.perf_counter() - T0


def over_budget():
    return ARGS is not None and elapsed() > ARGS.budget_s


def skip_note(name, why):
    log(f"    {name}: skipped ({why})")
    return None


def attempt(name, fn, *args, **kwargs):
    """fn(*args) or None, printing why on failure (optional pieces never end the run)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure of an optional piece is reported and skipped
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
            msg = "out of memory: " + msg
        log(f"    {name}: failed: {type(e).__name__}: {msg}")
        if os.environ.get("XLA_SSM_BENCH_DEBUG"):
            traceback.print_exc()
        return None


# ------------------------------------------------------------------------------------ references


def _softplus(x):
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _to_bdl(u, delta, B, C, z, layout):
    """u, delta, z to (batch, dim, seqlen) f32; B, C (rank 4) to (batch, groups, dstate, seqlen) f32."""
    f = lambda x: None if x is None else x.astype(jnp.float32)  # noqa: E731
    u, delta, B, C, z = map(f, (u, delta, B, C, z))
    if layout == "bld":
        u, delta = u.transpose(0, 2, 1), delta.transpose(0, 2, 1)
        z = None if z is None else z.transpose(0, 2, 1)
        B, C = B.transpose(0, 2, 3, 1), C.transpose(0, 2, 3, 1)
    return u, delta, B, C, z


def _finish(y, u, D, z, layout, dtype):
    if D is not None:
        y = y + D[None, :, None] * u
    if z is not None:
        y = y * (z * jax.nn.sigmoid(z))
    if layout == "bld":
        y = y.transpose(0, 2, 1)
    return y.astype(dtype)


def ref_lax_scan(u, delta, A, B, C, D, z, delta_bias, *, layout):
    """The straightforward JAX version: lax.scan over time, state (batch, dim, dstate) as carry."""
    dtype = u.dtype
    u, delta, B, C, z = _to_bdl(u, delta, B, C, z, layout)
    batch, dim, seqlen = u.shape
    dt = _softplus(delta + delta_bias[None, :, None])
    groups = B.shape[1]

    def step(h, xs):
        dt_l, dtu_l, B_l, C_l = xs  # (b, d), (b, d), (b, g, n), (b, g, n)
        B_l, C_l = jnp.repeat(B_l, dim // groups, axis=1), jnp.repeat(C_l, dim // groups, axis=1)
        h = jnp.exp(dt_l[..., None] * A) * h + dtu_l[..., None] * B_l
        return h, jnp.sum(h * C_l, axis=-1)

    xs = (jnp.moveaxis(dt, -1, 0), jnp.moveaxis(dt * u, -1, 0), jnp.moveaxis(B, -1, 0), jnp.moveaxis(C, -1, 0))
    h0 = jnp.zeros((batch, dim, A.shape[1]), jnp.float32)
    h, ys = jax.lax.scan(step, h0, xs)
    return _finish(jnp.moveaxis(ys, 0, -1), u, D, z, layout, dtype), h


def ref_associative_scan(u, delta, A, B, C, D, z, delta_bias, *, layout):
    """The parallel JAX version: lax.associative_scan over time of (decay, input) pairs; it
    materializes (batch, dim, seqlen, dstate) f32 arrays."""
    dtype = u.dtype
    u, delta, B, C, z = _to_bdl(u, delta, B, C, z, layout)
    batch, dim, seqlen = u.shape
    groups, dstate = B.shape[1], A.shape[1]
    dt = _softplus(delta + delta_bias[None, :, None])
    # Channels as (groups, dim / groups) so that B and C broadcast instead of being repeated.
    grouped = lambda x: x.reshape(batch, groups, dim // groups, seqlen, 1)  # noqa: E731
    dA = jnp.exp(grouped(dt) * A.reshape(1, groups, dim // groups, 1, dstate))
    dBu = grouped(dt * u) * jnp.swapaxes(B, -1, -2)[:, :, None]

    def combine(x, y):
        return x[0] * y[0], y[0] * x[1] + y[1]

    _, h = jax.lax.associative_scan(combine, (dA, dBu), axis=3)
    y = jnp.einsum("bgeln,bgnl->bgel", h, C).reshape(batch, dim, seqlen)
    return _finish(y, u, D, z, layout, dtype), h[:, :, :, -1, :].reshape(batch, dim, dstate)


def ours(u, delta, A, B, C, D, z, delta_bias, *, layout):
    return xla_ssm.selective_scan_fwd(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=True, layout=layout)


def rel_l2_device(x, ref):
    """Relative L2 error computed where the arrays are (f32 sums: plenty for a 2e-2 bound)."""
    x, ref = jnp.asarray(x, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


def rel_l2(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / (den if den > 0 else 1.0))


# ------------------------------------------------------------------------------------ inputs


def make_inputs(batch, dim, seqlen, dstate, dtype, layout, seed=0):
    """Mamba-like values: S4D-real A = -(1..dstate), delta_bias = softplus^-1 of dt drawn
    log-uniformly in [1e-3, 1e-1], one group of time-varying B/C in `dtype`."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    xshape = (batch, dim, seqlen) if layout == "bdl" else (batch, seqlen, dim)
    bcshape = (batch, 1, dstate, seqlen) if layout == "bdl" else (batch, seqlen, 1, dstate)

    @jax.jit
    def gen():
        u = jax.random.normal(ks[0], xshape, jnp.float32).astype(dtype)
        delta = (0.5 * jax.random.normal(ks[1], xshape, jnp.float32)).astype(dtype)
        z = jax.random.normal(ks[2], xshape, jnp.float32).astype(dtype)
        B = jax.random.normal(ks[3], bcshape, jnp.float32).astype(dtype)
        C = jax.random.normal(ks[4], bcshape, jnp.float32).astype(dtype)
        dt0 = jnp.exp(jax.random.uniform(ks[5], (dim,), jnp.float32, math.log(1e-3), math.log(1e-1)))
        delta_bias = dt0 + jnp.log(-jnp.expm1(-dt0))  # softplus^-1
        D = 1.0 + 0.1 * jax.random.normal(ks[6], (dim,), jnp.float32)
        A = -jnp.broadcast_to(jnp.arange(1, dstate + 1, dtype=jnp.float32), (dim, dstate))
        return dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias)

    x = gen()
    jax.block_until_ready(x)
    return x


ORDER = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def args_of(x):
    return tuple(x[k] for k in ORDER)


# ------------------------------------------------------------------------------------ timing


def time_jax(fn, args, *, reps, inner=1, warmup=1):
    """Median seconds per call over `reps` repetitions of `inner` back-to-back calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            r = fn(*args)
        jax.block_until_ready(r)
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


def time_adaptive(fn, args, *, reps, target_s, max_inner=200, slow_s=0.5):
    """Warm up (compiles), then choose the calls per repetition so that one repetition takes about
    `target_s`; calls slower than `slow_s` get at most 3 repetitions."""
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t  # includes compilation
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t
    inner = int(min(max_inner, max(1, target_s / max(one, 1e-6))))
    if one > slow_s:
        reps = min(reps, 3)
    return time_jax(fn, args, reps=reps, inner=inner, warmup=0), first


def fmt_us(s):
    return "-" if s is None else f"{s * 1e6:.0f}"


def fmt_ms(s):
    return "-" if s is None else f"{s * 1e3:.2f}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def fmt_x(r):
    return "-" if r is None else f"{r:.1f}x"


def print_table(headers, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)] if rows else [len(h) for h in headers]
    line = "  ".join(str(h).rjust(w) for h, w in zip(headers, widths))
    log(line)
    log("-" * len(line))
    for r in rows:
        log("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))


def write_results(out: Path, meta: dict, records: list[dict], stem: str):
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"{stem}.json", "w") as f:
            json.dump({"meta": meta, "results": records}, f, indent=2, default=str)
        keys = []
        for r in records:
            keys += [k for k in r if k not in keys]
        with open(out / f"{stem}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            for r in records:
                w.writerow(r)
        log(f"wrote {out / (stem + '.json')} and {out / (stem + '.csv')}")
    except OSError as e:
        log(f"could not write results to {out}: {e}")


def base_meta():
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "library": str(xla_ssm.library_path()),
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
    }


def _cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# ------------------------------------------------------------------------------------ CPU mode

CPU_SHAPES = [(2, 256, 512, 16), (2, 1024, 2048, 16), (1, 1536, 2048, 16)]
CPU_REP_S = 0.05  # seconds per timed repetition on the CPU
CPU_TOL = {"f32": 1e-4, "bf16": 2e-2}  # relative L2 of out (and of final_state in f32)


def run_cpu(args):
    log(f"xla_ssm CPU benchmark: {_cpu_model()}, {os.cpu_count()} cores, jax {jax.__version__} ({jax.default_backend()})")
    log(f"library: {xla_ssm.library_path()}")
    log("ours = the xla_ssm_selective_scan_fwd CPU target through jax.jit; baselines are jitted JAX on the same CPU")
    log("inputs: Mamba-like, time-varying B/C (1 group), D, z, delta_bias, softplus; layout bdl")
    log(f"times: median over N repetitions of back-to-back calls, ~{CPU_REP_S * 1e3:.0f} ms each, after warm-up\n")
    reps = args.reps or 10
    shapes = CPU_SHAPES[1:2] if args.quick else CPU_SHAPES
    dtypes = {"f32": jnp.float32, "bf16": jnp.bfloat16}
    layout = "bdl"
    records, rows = [], []
    for shape in shapes:
        for dname, dtype in dtypes.items():
            b, d, l, n = shape
            log(f"{shape} {dname}:")
            x = make_inputs(b, d, l, n, dtype, layout)
            a = args_of(x)
            f_ours = jax.jit(functools.partial(ours, layout=layout))
            f_scan = jax.jit(functools.partial(ref_lax_scan, layout=layout))
            f_assoc = jax.jit(functools.partial(ref_associative_scan, layout=layout))
            rec = {"device": "cpu", "batch": b, "dim": d, "seqlen": l, "dstate": n, "dtype": dname, "layout": layout}
            out_ours, st_ours = jax.block_until_ready(f_ours(*a))
            # Each repetition runs for ~50 ms (many calls on small shapes): a median of ten
            # single 0.5 ms calls moved by 20% between runs on this 2-core machine.
            rec["ours_s"] = time_adaptive(f_ours, a, reps=reps, target_s=CPU_REP_S, slow_s=2.0)[0]
            log(f"    ours: {fmt_ms(rec['ours_s'])} ms")
            rec["lax_scan_s"] = rec["assoc_s"] = None
            ref = None
            if not args.no_baselines:
                ref = attempt("lax.scan reference", lambda: jax.block_until_ready(f_scan(*a)))
                if ref is not None:
                    rec["lax_scan_s"] = attempt("lax.scan timing", lambda: time_adaptive(f_scan, a, reps=reps, target_s=CPU_REP_S, slow_s=2.0)[0])
                    log(f"    lax.scan: {fmt_ms(rec['lax_scan_s'])} ms")
                if over_budget():
                    skip_note("associative_scan", "time budget spent")
                else:
                    rec["assoc_s"] = attempt("associative_scan", lambda: time_adaptive(f_assoc, a, reps=reps, target_s=CPU_REP_S, slow_s=2.0)[0])
                    log(f"    associative_scan: {fmt_ms(rec['assoc_s'])} ms")
            if ref is None:  # the check needs a reference even without baselines
                ref = attempt("lax.scan reference", lambda: jax.block_until_ready(f_scan(*a)))
            if ref is not None:
                rec["rel_l2_out"] = rel_l2(out_ours, ref[0])
                rec["rel_l2_state"] = rel_l2(st_ours, ref[1])
                ok = rec["rel_l2_out"] < CPU_TOL[dname] and rec["rel_l2_state"] < CPU_TOL["f32"]
                rec["check"] = "ok" if ok else "MISMATCH"
                if not ok:
                    FAILURES.append(f"{shape} {dname}: rel L2 out {rec['rel_l2_out']:.2e}, state {rec['rel_l2_state']:.2e}")
            else:
                rec["rel_l2_out"] = rec["rel_l2_state"] = None
                rec["check"] = "no reference"
            rec["speedup_vs_lax_scan"] = ratio(rec["lax_scan_s"], rec["ours_s"])
            rec["speedup_vs_assoc"] = ratio(rec["assoc_s"], rec["ours_s"])
            records.append(rec)
            rows.append([
                f"{b}x{d}x{l}x{n}", dname, fmt_ms(rec["ours_s"]), fmt_ms(rec["lax_scan_s"]), fmt_ms(rec["assoc_s"]),
                fmt_x(rec["speedup_vs_lax_scan"]), fmt_x(rec["speedup_vs_assoc"]),
                "-" if rec["rel_l2_out"] is None else f"{rec['rel_l2_out']:.1e}", rec["check"],
            ])
            del x, a, out_ours, st_ours, ref
    log("")
    print_table(["batch x dim x seqlen x dstate", "dtype", "ours ms", "lax.scan ms", "assoc ms", "vs scan", "vs assoc", "relL2", "check"], rows)
    meta = base_meta() | {"mode": "cpu", "reps": reps, "layout": layout, "tolerance_rel_l2": CPU_TOL}
    write_results(args.out, meta, records, "cpu")
    return records


# ------------------------------------------------------------------------------------ GPU mode

MAIN = (8, 4096, 2048, 16)
GPU_SHAPES = [MAIN, (16, 5120, 2048, 16), (1, 4096, 16384, 16), (1, 1536, 2048, 16)]
# The official Mamba CUDA kernel (selective_scan_cuda, bf16, channel-first) on an H100, from the issue.
OFFICIAL_US = {MAIN: 1168, (16, 5120, 2048, 16): 2889, (1, 4096, 16384, 16): 1553, (1, 1536, 2048, 16): 70}
SWEEP_BATCHES = [1, 2, 4, 8, 16, 32, 64]
SWEEP_SHAPE = (4096, 2048, 16)  # dim, seqlen, dstate of the sweep
SWEEP_LAX_SCAN = {1, 8, 64}  # lax.scan is slow; a few points are enough
BOOST_CLOCK_HZ = 1.755e9  # H100 SXM boost clock, assumed for the exp-unit limit
EX2_PER_CLK_PER_SM = 16
GPU_TOL = 2e-2  # relative L2 of bf16 out


def _c_args_struct():
    """ctypes mirror of XlaSsmSelectiveScanFwdArgs, read from include/xla_ssm.h when it is there (so
    that fields added later are laid out right; they stay 0 / NULL), else the layout known here."""
    known = [
        ("batch", ctypes.c_int64), ("dim", ctypes.c_int64), ("seqlen", ctypes.c_int64),
        ("dstate", ctypes.c_int64), ("groups", ctypes.c_int64), ("dtype", ctypes.c_int32),
        ("bc_dtype", ctypes.c_int32), ("layout", ctypes.c_int32), ("delta_softplus", ctypes.c_bool),
    ] + [(name, ctypes.c_void_p) for name in (
        "u", "delta", "a", "b", "c", "d", "z", "delta_bias", "initial_state", "out", "final_state")]
    fields = known
    header = ROOT / "include" / "xla_ssm.h"
    try:
        import re

        text = header.read_text()
        body = re.search(r"typedef struct XlaSsmSelectiveScanFwdArgs\s*\{(.*?)\}\s*XlaSsmSelectiveScanFwdArgs;", text, re.S)
        ctype = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "uint64_t": ctypes.c_uint64,
                 "XlaSsmDtype": ctypes.c_int32, "XlaSsmLayout": ctypes.c_int32, "XlaSsmStatus": ctypes.c_int32,
                 "bool": ctypes.c_bool, "float": ctypes.c_float, "double": ctypes.c_double}
        parsed = []
        for decl in re.sub(r"//[^\n]*|/\*.*?\*/", "", body.group(1), flags=re.S).split(";"):
            decl = decl.strip()
            if not decl:
                continue
            m = re.match(r"(?:const\s+)?(\w+)\s*(\*?)\s*(\w+)$", decl.replace(" *", "*").replace("*", " * ").strip())
            if m is None:
                raise ValueError(f"unparsed field {decl!r}")
            base, star, name = m.groups()
            parsed.append((name, ctypes.c_void_p if star else ctype[base]))
        fields = parsed
    except Exception as e:  # noqa: BLE001
        log(f"(C API: using the built-in argument layout; could not read {header}: {e})")

    class Args(ctypes.Structure):
        _fields_ = fields

    return Args


class CApi:
    """`xla_ssm_selective_scan_fwd_cuda_launch` through ctypes, on PyTorch tensors."""

    F32, BF16, F16 = 0, 1, 2

    def __init__(self, torch):
        self.torch = torch
        self.lib = xla_ssm.load()
        self.Args = _c_args_struct()
        self.launch_fn = self.lib.xla_ssm_selective_scan_fwd_cuda_launch
        self.launch_fn.argtypes = [ctypes.POINTER(self.Args), ctypes.c_void_p]
        self.launch_fn.restype = ctypes.c_int32
        self.lib.xla_ssm_last_error.restype = ctypes.c_char_p

    def prepare(self, t, layout):
        """t: dict of torch tensors (inputs); returns (launch, out, final_state)."""
        torch = self.torch
        u = t["u"]
        if layout == "bdl":
            batch, dim, seqlen = u.shape
            groups = t["B"].shape[1]
        else:
            batch, seqlen, dim = u.shape
            groups = t["B"].shape[2]
        dstate = t["A"].shape[1]
        code = {torch.float32: self.F32, torch.bfloat16: self.BF16, torch.float16: self.F16}
        out = torch.empty_like(u)
        final = torch.empty((batch, dim, dstate), dtype=torch.float32, device=u.device)
        ptr = lambda x: ctypes.c_void_p(x.data_ptr())  # noqa: E731
        self._keep = (t, out, final)
        values = dict(
            batch=batch, dim=dim, seqlen=seqlen, dstate=dstate, groups=groups, dtype=code[u.dtype],
            bc_dtype=code[t["B"].dtype], layout=0 if layout == "bdl" else 1, delta_softplus=True,
            u=ptr(u), delta=ptr(t["delta"]), a=ptr(t["A"]), b=ptr(t["B"]), c=ptr(t["C"]), d=ptr(t["D"]),
            z=ptr(t["z"]), delta_bias=ptr(t["delta_bias"]), initial_state=None, out=ptr(out), final_state=ptr(final),
        )
        names = [f[0] for f in self.Args._fields_]
        # Scratch that lets the CUDA scan split long sequences of small batch x dim (newer libraries).
        ws_fn = getattr(self.lib, "xla_ssm_selective_scan_fwd_workspace_bytes", None)
        if ws_fn is not None and "workspace" in names and "workspace_bytes" in names:
            ws_fn.argtypes = [ctypes.c_int64] * 4
            ws_fn.restype = ctypes.c_int64
            nbytes = int(ws_fn(batch, dim, seqlen, dstate))
            if nbytes > 0:
                workspace = torch.empty(nbytes, dtype=torch.uint8, device=u.device)
                self._keep += (workspace,)
                values.update(workspace=ptr(workspace), workspace_bytes=nbytes)
        missing = [k for k in values if k not in names]
        if missing:
            raise RuntimeError(f"XlaSsmSelectiveScanFwdArgs has no field(s) {missing}; fields: {names}")
        args = self.Args(**{k: v for k, v in values.items() if v is not None})
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

        def launch():
            status = self.launch_fn(ctypes.byref(args), stream)
            if status != 0:
                raise RuntimeError(f"xla_ssm C API status {status}: {self.lib.xla_ssm_last_error().decode()}")

        return launch, out, final


def torch_time(torch, fn, *, reps, inner, warmup=2):
    """Median seconds per call, CUDA events around `inner` back-to-back calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / inner)
    return statistics.median(times)


def torch_reference(torch, t, layout):
    """PyTorch eager: a loop over time with (batch, dim, dstate) ops, f32, like ref_lax_scan."""
    F = torch.nn.functional
    u, delta, B, C, z = (t[k].float() for k in ("u", "delta", "B", "C", "z"))
    if layout == "bld":
        u, delta, z = u.transpose(1, 2), delta.transpose(1, 2), z.transpose(1, 2)
        B, C = B.permute(0, 2, 3, 1), C.permute(0, 2, 3, 1)
    batch, dim, seqlen = u.shape
    groups, dstate = B.shape[1], t["A"].shape[1]
    # Channels as (groups, dim / groups): B and C broadcast over a group's channels.
    A = t["A"].reshape(groups, dim // groups, dstate)
    D, bias = t["D"], t["delta_bias"]
    B, C = B[:, :, None], C[:, :, None]  # (b, g, 1, n, l)
    dt = F.softplus(delta + bias[None, :, None], threshold=20.0)
    dtu = (dt * u).reshape(batch, groups, dim // groups, seqlen)
    dt = dt.reshape(batch, groups, dim // groups, seqlen)
    h = torch.zeros(batch, groups, dim // groups, dstate, device=u.device, dtype=torch.float32)
    y = torch.empty(batch, groups, dim // groups, seqlen, device=u.device, dtype=torch.float32)
    for step in range(seqlen):
        h = torch.exp(dt[..., step, None] * A) * h + dtu[..., step, None] * B[..., step]
        y[..., step] = (h * C[..., step]).sum(-1)
    y = (y.reshape(batch, dim, seqlen) + D[None, :, None] * u) * F.silu(z)
    if layout == "bld":
        y = y.transpose(1, 2)
    return y.to(t["u"].dtype), h.reshape(batch, dim, dstate)


def copy_rate(torch):
    """Device-to-device copy rate, bytes read + written per second (median of 10 copies of 2 GiB)."""
    n = 1 << 30  # bf16 elements: 2 GiB
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    src.fill_(1.0)
    per = torch_time(torch, lambda: dst.copy_(src), reps=5, inner=4, warmup=2)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2 * n / per


def io_bytes(b, d, l, n):
    """u, delta, z, out (bf16) and B, C (bf16, one group) read or written once."""
    return 4 * b * d * l * 2 + 2 * b * n * l * 2


def assoc_bytes(b, d, l, n):
    """Rough peak memory of the associative_scan reference: a few (b, d, l, n) f32 arrays."""
    return 5 * b * d * l * n * 4


def run_gpu(args):
    global MAIN, GPU_SHAPES, SWEEP_BATCHES, SWEEP_SHAPE
    devs = [d for d in jax.devices() if d.platform == "gpu"]
    if args.dry_run:
        log("DRY RUN: tiny shapes on " + str(jax.devices()[0]) + "; the figures mean nothing")
        devs = jax.devices()
        MAIN = (2, 64, 128, 16)
        GPU_SHAPES = [MAIN, (1, 32, 256, 16)]
        SWEEP_BATCHES, SWEEP_SHAPE = [1, 2, 4], (64, 128, 16)
        OFFICIAL_US[MAIN] = 1168
    if args.dstate != 16:
        with_dstate = lambda shape: (*shape[:-1], args.dstate)
        MAIN, GPU_SHAPES, SWEEP_SHAPE = with_dstate(MAIN), [with_dstate(s) for s in GPU_SHAPES], with_dstate(SWEEP_SHAPE)
    if not devs:
        log(f"no GPU in jax (backend {jax.default_backend()}, devices {jax.devices()}); "
            "--device gpu needs jax with CUDA (pip install 'jax[cuda13]')")
        return None
    try:
        import torch
        if not torch.cuda.is_available():
            log("torch is installed but sees no CUDA device: skipping the C API, torch eager and copy-rate parts")
            torch = None
    except ImportError:
        log("torch is not installed: skipping the C API, torch eager and copy-rate parts")
        torch = None
    capi = attempt("C API setup", CApi, torch) if torch is not None else None

    sms, name = 132, devs[0].device_kind
    if torch is not None:
        prop = torch.cuda.get_device_properties(0)
        sms, name = prop.multi_processor_count, prop.name
    else:
        log("SM count unknown without torch: assuming 132 (H100 SXM)")
    exp_rate = sms * EX2_PER_CLK_PER_SM * BOOST_CLOCK_HZ
    log(f"xla_ssm GPU benchmark on {name} ({sms} SMs), jax {jax.__version__}"
        + (f", torch {torch.__version__}" if torch is not None else ""))
    log(f"library: {xla_ssm.library_path()}")
    log(f"exp-unit limit: batch*dim*seqlen*dstate exps / ({sms} SMs * {EX2_PER_CLK_PER_SM} ex2/clk * "
        f"{BOOST_CLOCK_HZ / 1e9:.3f} GHz, the H100 SXM boost clock, assumed)")
    bw = attempt("HBM copy rate", copy_rate, torch) if torch is not None else None
    if bw:
        log(f"HBM limit: bytes of u, delta, z, out, B, C once / measured copy rate {bw / 1e12:.2f} TB/s")
    log("inputs: bf16 u/delta/z/B/C (1 group), f32 A/D/delta_bias, softplus; timing: median per call\n")

    reps = args.reps or 5
    cases = [(s, lay) for s in (GPU_SHAPES[:1] if args.quick else GPU_SHAPES) for lay in ("bdl", "bld")]
    if not args.quick and not args.no_sweep:
        cases += [((bs, *SWEEP_SHAPE), "bdl", "sweep") for bs in SWEEP_BATCHES]
    records = []
    traced = False
    for case in cases:
        shape, layout = case[0], case[1]
        sweep = len(case) > 2
        b, d, l, n = shape
        log(f"{'sweep ' if sweep else ''}{shape} {layout}:  [{elapsed():.0f} s]")
        rec = {"device": name, "batch": b, "dim": d, "seqlen": l, "dstate": n, "layout": layout, "sweep": sweep}
        x = attempt("inputs", make_inputs, b, d, l, n, jnp.bfloat16, layout)
        if x is None:
            FAILURES.append(f"{shape} {layout}: could not make inputs")
            continue
        a = args_of(x)
        f_ours = jax.jit(functools.partial(ours, layout=layout))
        res = attempt("ours (jax)", lambda: time_adaptive(f_ours, a, reps=reps, target_s=0.1, max_inner=500))
        rec["ours_jax_s"] = res[0] if res else None
        out_ours = attempt("ours (jax) output", lambda: jax.block_until_ready(f_ours(*a)))
        log(f"    ours via jax.jit: {fmt_us(rec['ours_jax_s'])} us")

        # The C API on the same buffers (shared with torch through DLPack), timed with CUDA events.
        rec["ours_capi_s"] = None
        t = attempt("DLPack to torch", lambda: {k: torch.from_dlpack(v) for k, v in x.items()}) if torch else None
        prep = attempt("C API prepare", capi.prepare, t, layout) if capi is not None and t is not None else None
        if prep is not None:
            launch, out_c, _ = prep
            one = attempt("C API launch", lambda: torch_time(torch, launch, reps=1, inner=1, warmup=1))
            if one is not None:
                inner = int(min(500, max(1, 0.1 / max(one, 1e-6))))
                rec["ours_capi_s"] = attempt("C API timing", lambda: torch_time(torch, launch, reps=reps, inner=inner))
                log(f"    ours via C API: {fmt_us(rec['ours_capi_s'])} us")
                if out_ours is not None:
                    torch.cuda.synchronize()
                    diff = (out_c.float() - torch.from_dlpack(out_ours[0]).float()).abs().max()
                    rec["capi_vs_jax_max_abs"] = float(diff)
                if not traced and shape == MAIN and layout == "bdl":
                    # JAX's first: once torch's profiler has subscribed to CUPTI, JAX's cannot.
                    attempt("jax.profiler trace", trace_jax, f_ours, a, args.out)
                    attempt("torch.profiler trace", trace_capi, torch, launch, args.out)
                    traced = True
            del prep, launch, out_c
            capi._keep = None

        # Baselines.
        def want(kind):
            if args.no_baselines:
                return False
            if over_budget():
                skip_note(kind, "time budget spent")
                return False
            return True

        rec["assoc_s"] = rec["lax_scan_s"] = rec["torch_eager_s"] = None
        free = None
        if torch is not None:
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info()[0]
        if want("associative_scan"):
            need = assoc_bytes(b, d, l, n)
            if free is not None and need > 0.9 * free:
                skip_note("associative_scan", f"needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free")
            else:
                f_assoc = jax.jit(functools.partial(ref_associative_scan, layout=layout))
                res = attempt("associative_scan", lambda: time_adaptive(f_assoc, a, reps=reps, target_s=0.2, slow_s=0.5))
                rec["assoc_s"] = res[0] if res else None
                log(f"    lax.associative_scan: {fmt_us(rec['assoc_s'])} us")
                del f_assoc
        ref, ref_name = None, None
        f_scan = jax.jit(functools.partial(ref_lax_scan, layout=layout))
        if (not sweep or b in SWEEP_LAX_SCAN) and want("lax.scan"):
            res = attempt("lax.scan", lambda: time_adaptive(f_scan, a, reps=3, target_s=0.2, slow_s=0.3))
            rec["lax_scan_s"] = res[0] if res else None
            log(f"    lax.scan: {fmt_us(rec['lax_scan_s'])} us")
        if torch is not None and t is not None and (shape == MAIN or sweep) and want("torch eager"):
            with torch.inference_mode():
                rec["torch_eager_s"] = attempt("torch eager", lambda: torch_time(
                    torch, lambda: torch_reference(torch, t, layout), reps=2, inner=1, warmup=1))
            log(f"    torch eager (loop over seqlen): {fmt_us(rec['torch_eager_s'])} us")

        # The check: against lax.scan (any size; it only keeps the state), else torch eager.
        if out_ours is not None:
            ref = attempt("lax.scan reference", lambda: jax.block_until_ready(f_scan(*a)))
            ref_name = "lax.scan"
            if ref is None and torch is not None and t is not None:
                with torch.inference_mode():
                    ref = attempt("torch reference", torch_reference, torch, t, layout)
                ref = None if ref is None else (jnp.asarray(ref[0].float().cpu().numpy()), None)  # host copy: any jax device
                ref_name = "torch eager"
            if ref is not None:
                rec["rel_l2_out"] = rel_l2_device(out_ours[0], ref[0])
                rec["check"] = "ok" if rec["rel_l2_out"] < GPU_TOL else "MISMATCH"
                rec["reference"] = ref_name
                if rec["check"] != "ok":
                    FAILURES.append(f"{shape} {layout}: rel L2 {rec['rel_l2_out']:.2e} vs {ref_name}")
            else:
                rec["check"] = "no reference"
        else:
            rec["check"] = "ours failed"
            FAILURES.append(f"{shape} {layout}: our target failed")
        log(f"    check: {rec['check']}" + (f" (rel L2 {rec['rel_l2_out']:.1e} vs {ref_name})" if "rel_l2_out" in rec else ""))

        best = rec["ours_capi_s"] or rec["ours_jax_s"]
        rec["speedup_vs_assoc"] = ratio(rec["assoc_s"], rec["ours_jax_s"])
        rec["speedup_vs_lax_scan"] = ratio(rec["lax_scan_s"], rec["ours_jax_s"])
        rec["speedup_vs_torch_eager"] = ratio(rec["torch_eager_s"], rec["ours_jax_s"])
        rec["official_us"] = OFFICIAL_US.get(shape)
        rec["speedup_vs_official"] = ratio(rec["official_us"] * 1e-6 if rec["official_us"] else None, best)
        rec["exp_limit_s"] = b * d * l * n / exp_rate
        rec["hbm_limit_s"] = io_bytes(b, d, l, n) / bw if bw else None
        rec["frac_exp_limit"] = ratio(rec["exp_limit_s"], best)
        rec["frac_hbm_limit"] = ratio(rec["hbm_limit_s"], best)
        records.append(rec)
        del x, a, out_ours, t, ref, f_ours, f_scan
        if torch is not None:
            torch.cuda.empty_cache()

    report_gpu(records, args, name, sms, bw)
    return records


def trace_capi(torch, launch, out: Path):
    import warnings

    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    launch()
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            launch()
            torch.cuda.synchronize()
    path = out / "trace_capi_main_bdl.json"
    prof.export_chrome_trace(str(path))
    log(f"    wrote {path} (chrome://tracing or ui.perfetto.dev)")


def trace_jax(fn, args, out: Path):
    import glob
    import shutil

    path = out / "jax_trace_main_bdl"
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(str(path), create_perfetto_trace=True):
        jax.block_until_ready(fn(*args))
    # The profiler nests its files in plugins/profile/<run>/; put the Perfetto trace at the top.
    found = sorted(glob.glob(str(path / "**" / "perfetto_trace.json.gz"), recursive=True))
    if found:
        shutil.copy(found[-1], out / "jax_trace_main_bdl.perfetto.json.gz")
        log(f"    wrote {out / 'jax_trace_main_bdl.perfetto.json.gz'} (ui.perfetto.dev) and {path}/ (TensorBoard)")
    else:
        log(f"    wrote {path}/ (TensorBoard's profile plugin)")


def report_gpu(records, args, name, sms, bw):
    main_rows, sweep_rows = [], []
    for r in records:
        best = r["ours_capi_s"] or r["ours_jax_s"]
        row = [
            f"{r['batch']}x{r['dim']}x{r['seqlen']}x{r['dstate']}", r["layout"],
            fmt_us(r["ours_jax_s"]), fmt_us(r["ours_capi_s"]), fmt_us(r["assoc_s"]), fmt_us(r["lax_scan_s"]),
            fmt_us(r["torch_eager_s"]), fmt_x(r["speedup_vs_assoc"]), fmt_x(r["speedup_vs_lax_scan"]),
            fmt_x(r["speedup_vs_torch_eager"]),
            "-" if not r["official_us"] else f"{r['official_us']}", fmt_x(r["speedup_vs_official"]),
            f"{r['exp_limit_s'] * 1e6:.0f} ({r['frac_exp_limit'] * 100:.0f}%)" if best else f"{r['exp_limit_s'] * 1e6:.0f}",
            "-" if r["hbm_limit_s"] is None else (
                f"{r['hbm_limit_s'] * 1e6:.0f} ({r['frac_hbm_limit'] * 100:.0f}%)" if best else f"{r['hbm_limit_s'] * 1e6:.0f}"),
            r["check"],
        ]
        (sweep_rows if r["sweep"] else main_rows).append(row)
    headers = ["b x d x l x n", "layout", "ours jax us", "ours C us", "assoc us", "scan us", "torch us",
               "vs assoc", "vs scan", "vs torch", "official us", "vs official", "exp limit us (%)", "HBM limit us (%)", "check"]
    log("")
    log(f"{name}: times per call in microseconds; speedups of ours via jax.jit; 'vs official' uses ours via the "
        "C API (else jax) against the official Mamba kernel's figures from the issue (bdl, H100);")
    log(f"limit columns: the time at the limit and, in parentheses, how much of it ours reaches (exp units at "
        f"{BOOST_CLOCK_HZ / 1e9:.3f} GHz assumed; HBM at the measured copy rate"
        + (f" {bw / 1e12:.2f} TB/s" if bw else ", not measured") + ")")
    print_table(headers, main_rows)
    if sweep_rows:
        log("\nbatch sweep (dim %d, seqlen %d, dstate %d, bdl):" % SWEEP_SHAPE)
        print_table(headers, sweep_rows)
    meta = base_meta() | {
        "mode": "gpu", "gpu": name, "sms": sms, "boost_clock_hz_assumed": BOOST_CLOCK_HZ,
        "ex2_per_clk_per_sm": EX2_PER_CLK_PER_SM, "copy_rate_bytes_per_s": bw, "official_us": {str(k): v for k, v in OFFICIAL_US.items()},
        "tolerance_rel_l2": GPU_TOL,
    }
    write_results(args.out, meta, records, "gpu")
    attempt("plot", plot_sweep, [r for r in records if r["sweep"]], args.out)


def plot_sweep(records, out: Path):
    if not records:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401
    except ImportError:
        log("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    batches = [r["batch"] for r in records]
    for key, label in (("speedup_vs_assoc", "vs jax.lax.associative_scan"), ("speedup_vs_torch_eager", "vs PyTorch eager loop"),
                       ("speedup_vs_lax_scan", "vs jax.lax.scan")):
        pts = [(r["batch"], r[key]) for r in records if r.get(key)]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("batch (dim %d, seqlen %d, dstate %d, bf16, bdl)" % SWEEP_SHAPE)
    ax.set_ylabel("speedup of xla_ssm (jax.jit)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title("selective_scan_fwd: speedup against batch size")
    fig.tight_layout()
    path = out / "speedup_vs_batch.png"
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


# ------------------------------------------------------------------------------------ main


def main():
    args = ARGS
    try:
        xla_ssm.load()
    except Exception as e:  # noqa: BLE001
        log(f"cannot load libxla_ssm: {e}")
        return 2
    records = run_cpu(args) if args.device == "cpu" else run_gpu(args)
    log(f"\ntotal {elapsed():.0f} s")
    if not records:
        log("nothing ran")
        return 2
    if FAILURES:
        log("MISMATCHES / FAILURES:\n  " + "\n  ".join(FAILURES))
        return 1
    log("all outputs agree with the references")
    return 0


if __name__ == "__main__":
    sys.exit(main())
