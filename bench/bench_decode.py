"""Decode-step benchmark: `selective_state_update` and the fused `mamba_decode_step`.

GPU (`--device gpu`): per shape (bf16 x/dt/z/B/C, f32 state, D, dt_bias, softplus),
  - JAX: one jitted step with the state donated, called from Python (wall clock per call, host
    dispatch included); a jitted 128-token decode loop (lax.scan, state in the carry), and the same
    loop unrolled (one straight-line program: XLA may put it in a CUDA graph), time per token;
  - C API via ctypes on PyTorch's stream: CUDA-event time of 1000 back-to-back launches, and of a
    CUDA graph of 100 launches replayed (launch overhead amortized), per launch;
  - the pure-jnp reference step, jitted, for comparison;
  effective bandwidth = bytes necessarily moved (state read + written, x, dt, z, out, B, C, A, D,
  dt_bias) / time.
CPU (`--device cpu`, CI smoke): small shapes, outputs checked against the reference, timings printed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bindings" / "python"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import xla_ssm  # noqa: E402

GPU_SHAPES = [(1, 4096, 16), (256, 5120, 16), (8, 4096, 16), (64, 5120, 16)]
CPU_SHAPES = [(1, 256, 16), (4, 512, 16)]
LOOP = 128


def inputs(batch, dim, dstate, dtype=jnp.bfloat16, width=4, seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s, dt=dtype, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, dt)  # noqa: E731
    return dict(
        state=r(batch, dim, dstate, dt=jnp.float32),
        x=r(batch, dim),
        dt=r(batch, dim, sc=0.5),
        A=-jnp.asarray(rng.uniform(0.1, 2, (dim, dstate)), jnp.float32),
        B=r(batch, 1, dstate),
        C=r(batch, 1, dstate),
        D=r(dim, dt=jnp.float32),
        z=r(batch, dim),
        dt_bias=r(dim, dt=jnp.float32, sc=0.3),
        conv_state=r(batch, dim, width - 1),
        conv_weight=r(dim, width, dt=jnp.float32, sc=0.5),
        conv_bias=r(dim, dt=jnp.float32),
    )


def bytes_moved(batch, dim, dstate, fused=False, width=4):
    n = 2 * batch * dim * dstate * 4 + 4 * batch * dim * 2 + 2 * batch * dstate * 2 + dim * dstate * 4 + 2 * dim * 4
    if fused:
        n += 2 * batch * dim * (width - 1) * 2 + dim * (width + 1) * 4
    return n


def wall(f, *args, reps):
    out = f(*args)
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps


def median_wall(f, *args, reps, rounds=5):
    return float(np.median([wall(f, *args, reps=reps) for _ in range(rounds)]))


def jax_timings(kw, fused):
    ssm = {k: kw[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")}

    def step(state, conv_state):
        if fused:
            y, cs, st = xla_ssm.mamba_decode_step(
                ssm["x"], conv_state, kw["conv_weight"], state, ssm["dt"], ssm["A"], ssm["B"], ssm["C"],
                kw["conv_bias"], ssm["D"], ssm["z"], ssm["dt_bias"], dt_softplus=True,
            )
            return y, st, cs
        y, st = xla_ssm.selective_state_update(state, **ssm, dt_softplus=True)
        return y, st, conv_state

    one = jax.jit(step, donate_argnums=(0, 1))
    state, cs = jnp.array(kw["state"]), jnp.array(kw["conv_state"])

    def call_one():
        nonlocal state, cs
        y, state, cs = one(state, cs)
        return y

    t_step = median_wall(call_one, reps=200)

    def loop(unroll):
        def body(carry, _):
            st, c = carry
            y, st, c = step(st, c)
            return (st, c), y[0, 0]

        return jax.jit(lambda st, c: jax.lax.scan(body, (st, c), None, length=LOOP, unroll=unroll), donate_argnums=(0, 1))

    res = {"jit_step_us": t_step * 1e6}
    for name, unroll in (("scan_loop_us", 1), ("unrolled_loop_us", LOOP)):
        f = loop(unroll)
        carry = (jnp.array(kw["state"]), jnp.array(kw["conv_state"]))

        def call_loop():
            nonlocal carry
            carry, ys = f(*carry)
            return ys

        res[name] = median_wall(call_loop, reps=5) / LOOP * 1e6
    return res


def ref_timing(kw):
    ssm = {k: kw[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")}
    f = jax.jit(lambda st: xla_ssm.selective_state_update_ref(st, **ssm, dt_softplus=True))
    return median_wall(f, kw["state"], reps=100) * 1e6


class UpdateArgs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("batch", "dim", "dstate", "groups", "n_slots")] + [
        (n, ctypes.c_int32) for n in ("dtype", "bc_dtype", "state_dtype")
    ] + [("dt_softplus", ctypes.c_bool)] + [
        (n, ctypes.c_void_p) for n in ("state", "x", "dt", "a", "b", "c", "d", "z", "dt_bias", "state_batch_indices", "out")
    ]


class DecodeArgs(ctypes.Structure):
    _fields_ = [("ssm", UpdateArgs), ("width", ctypes.c_int64), ("conv_dtype", ctypes.c_int32)] + [
        (n, ctypes.c_void_p) for n in ("conv_state", "conv_weight", "conv_bias")
    ]


def capi_timings(batch, dim, dstate, fused):
    """C API launches on PyTorch's stream (device memory from torch); None without torch/CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    lib = xla_ssm.load()
    dev = "cuda"
    bf, f32 = torch.bfloat16, torch.float32
    t = dict(
        state=torch.randn(batch, dim, dstate, device=dev, dtype=f32),
        x=torch.randn(batch, dim, device=dev, dtype=bf),
        dt=torch.randn(batch, dim, device=dev, dtype=bf) * 0.5,
        a=-torch.rand(dim, dstate, device=dev, dtype=f32) - 0.1,
        b=torch.randn(batch, 1, dstate, device=dev, dtype=bf),
        c=torch.randn(batch, 1, dstate, device=dev, dtype=bf),
        d=torch.randn(dim, device=dev, dtype=f32),
        z=torch.randn(batch, dim, device=dev, dtype=bf),
        dt_bias=torch.randn(dim, device=dev, dtype=f32) * 0.3,
        out=torch.empty(batch, dim, device=dev, dtype=bf),
        conv_state=torch.randn(batch, dim, 3, device=dev, dtype=bf),
        conv_weight=torch.randn(dim, 4, device=dev, dtype=f32),
        conv_bias=torch.randn(dim, device=dev, dtype=f32),
    )
    ua = UpdateArgs(batch, dim, dstate, 1, batch, 1, 1, 0, True, *(t[k].data_ptr() for k in ("state", "x", "dt", "a", "b", "c", "d", "z", "dt_bias")), None, t["out"].data_ptr())
    if fused:
        args = DecodeArgs(ua, 4, 0, t["conv_state"].data_ptr(), t["conv_weight"].data_ptr(), t["conv_bias"].data_ptr())
        fn = lib.xla_ssm_mamba_decode_step_cuda_launch
    else:
        args = ua
        fn = lib.xla_ssm_selective_state_update_cuda_launch
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    ptr = ctypes.addressof(args)

    def launch():
        status = fn(ptr, torch.cuda.current_stream().cuda_stream)
        if status:
            raise RuntimeError(ctypes.string_at(lib.xla_ssm_last_error()).decode())

    lib.xla_ssm_last_error.restype = ctypes.c_void_p
    for _ in range(10):
        launch()
    torch.cuda.synchronize()

    def events(f, n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        f()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / n

    n = 1000
    direct = float(np.median([events(lambda: [launch() for _ in range(n)], n) for _ in range(5)]))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
            for _ in range(100):
                launch()
    torch.cuda.synchronize()
    graph = float(np.median([events(lambda: [g.replay() for _ in range(10)], 1000) for _ in range(5)]))
    return {"capi_us": direct, "capi_graph_us": graph}


def gpu(args):
    rows = []
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else GPU_SHAPES
    for batch, dim, dstate in shapes:
        for fused in (False, True):
            kw = inputs(batch, dim, dstate)
            r = {"op": "mamba_decode_step" if fused else "selective_state_update", "batch": batch, "dim": dim, "dstate": dstate}
            r.update(jax_timings(kw, fused))
            if not fused:
                r["jnp_ref_jit_us"] = ref_timing(kw)
            c = capi_timings(batch, dim, dstate, fused)
            if c:
                r.update(c)
            best = min(v for k, v in r.items() if k.endswith("_us") and k != "jnp_ref_jit_us" and k != "jit_step_us")
            r["best_us"] = best
            r["eff_TBps"] = bytes_moved(batch, dim, dstate, fused) / (best * 1e-6) / 1e12
            rows.append(r)
            print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    return rows


def cpu(args):
    rows = []
    for batch, dim, dstate in CPU_SHAPES:
        kw = inputs(batch, dim, dstate, dtype=jnp.float32)
        ssm = {k: kw[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")}
        f = jax.jit(lambda st: xla_ssm.selective_state_update(st, **ssm, dt_softplus=True))
        ref = jax.jit(lambda st: xla_ssm.selective_state_update_ref(st, **ssm, dt_softplus=True))
        (y, st), (wy, wst) = f(kw["state"]), ref(kw["state"])
        for got, want in ((y, wy), (st, wst)):
            err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
            assert err < 1e-5, f"CPU state update differs from the reference: {err:.2e}"
        r = {"op": "selective_state_update", "batch": batch, "dim": dim, "dstate": dstate,
             "cpu_us": median_wall(f, kw["state"], reps=20) * 1e6, "jnp_ref_us": median_wall(ref, kw["state"], reps=20) * 1e6}
        rows.append(r)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--shapes", default="", help="e.g. 1x4096x16,256x5120x16 (GPU; default: all)")
    p.add_argument("--tag", default="", help="suffix of the results file")
    args = p.parse_args()
    rows = gpu(args) if args.device == "gpu" else cpu(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"decode_{args.device}{args.tag}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
