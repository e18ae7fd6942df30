"""Two builds of the library, side by side: the main shape of every operation, timed through
`jax.jit` with each library in turn (a fresh process per library and round, the libraries
alternating), medians and the ratio new / old printed. For refactors that must not change speed.

    PYTHONPATH=bindings/python python bench/compare_libraries.py OLD.so NEW.so [--rounds 3] [--ops a,b]

GPU only (the CUDA targets). Each process times every op with CUDA-synchronized wall clock over
`--reps` calls (median of 5 such trials) after a warm-up; outputs of the two libraries are compared
(same inputs, same seed) so a faster but wrong build does not pass unnoticed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# The selective scan's cases: (layout, batch, dim, seqlen, dstate, with the backward). The main
# shape takes one thread a channel; the others take the kernels of 2 to 16 threads a channel, the
# sequence split (1 x 16384) and the small-grid plan (1 x 1536).
SCANS = {
    "scan_fwd_bdl": ("bdl", 8, 4096, 2048, 16, False),
    "scan_fwd_bld": ("bld", 8, 4096, 2048, 16, False),
    "scan_fwd_bwd": ("bdl", 8, 4096, 2048, 16, True),
    "scan_fwd_long": ("bdl", 1, 4096, 16384, 16, False),
    "scan_fwd_small": ("bdl", 1, 1536, 2048, 16, False),
    "scan_fwd_n64": ("bdl", 8, 4096, 2048, 64, False),
    "scan_fwd_n128_bld": ("bld", 2, 2048, 2048, 128, False),
    "scan_fwd_bwd_bld": ("bld", 8, 4096, 2048, 16, True),
    "scan_fwd_bwd_long": ("bdl", 1, 4096, 16384, 16, True),
    "scan_fwd_bwd_n64": ("bdl", 4, 4096, 2048, 64, True),
}
OPS = {
    # name: description
    **{
        name: f"selective scan forward{' + backward (jax.vjp)' if bwd else ''}, bf16 {b}x{d}x{l}x{n} {layout}, z D "
        "delta_bias softplus"
        for name, (layout, b, d, l, n, bwd) in SCANS.items()
    },
    "ssd_fwd": "SSD forward, bf16 8x2048, 64 heads x 64, dstate 128, chunk 256, D softplus",
    "ssd_fwd_bwd": "SSD forward + backward (jax.vjp), same shape",
    "decode_b1": "fused decode step, batch 1, dim 4096, dstate 16, bf16",
    "decode_b256": "selective state update, batch 256, dim 5120, dstate 16, f32 state",
    "conv1d": "causal conv1d forward + backward, bf16 8x4096x2048, width 4",
}


def worker(ops, reps, out_path):
    """Times `ops` with the library in $XLA_SSM_LIBRARY; writes {op: (median seconds, checksum)}."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import xla_ssm

    bf16, f32 = jnp.bfloat16, jnp.float32
    key = iter(jax.random.split(jax.random.PRNGKey(0), 256))

    def rnd(shape, dtype=bf16, scale=1.0):
        return (scale * jax.random.normal(next(key), shape, f32)).astype(dtype)

    def scan_args(layout, b, d, l, n):
        x = (b, d, l) if layout == "bdl" else (b, l, d)
        bc = (b, 1, n, l) if layout == "bdl" else (b, l, 1, n)
        a = -jnp.exp(rnd((d, n), f32, 0.5))
        return (rnd(x), rnd(x, scale=0.5), a, rnd(bc), rnd(bc)), dict(
            D=rnd((d,), f32), z=rnd(x), delta_bias=rnd((d,), f32, 0.1), delta_softplus=True, layout=layout
        )

    def ssd_args():
        b, l, h, p, n = 8, 2048, 64, 64, 128
        a = -jnp.exp(rnd((h,), f32, 0.5))
        return (rnd((b, l, h, p)), rnd((b, l, h), scale=0.5), a, rnd((b, l, 1, n)), rnd((b, l, 1, n))), dict(
            D=rnd((h,), f32), dt_softplus=True, chunk_size=256
        )

    def build(op):
        if op in SCANS:
            layout, *shape, bwd = SCANS[op]
            args, kw = scan_args(layout, *shape)
            if not bwd:
                return jax.jit(lambda *a: xla_ssm.selective_scan(*a, **kw)), args

            def f(*a):
                out, pull = jax.vjp(lambda *a: xla_ssm.selective_scan(*a, **kw), *a)
                return out, pull(out)

            return jax.jit(f), args
        if op == "ssd_fwd":
            args, kw = ssd_args()
            return jax.jit(lambda *a: xla_ssm.ssd(*a, **kw)), args
        if op == "ssd_fwd_bwd":
            args, kw = ssd_args()

            def f(*a):
                out, pull = jax.vjp(lambda *a: xla_ssm.ssd(*a, **kw), *a)
                return out, pull(out)

            return jax.jit(f), args
        if op == "decode_b1":
            b, d, n, w = 1, 4096, 16, 4
            args = (rnd((b, d)), rnd((b, d, w - 1)), rnd((d, w)), jnp.zeros((b, d, n), f32), rnd((b, d)),
                    -jnp.exp(rnd((d, n), f32, 0.5)), rnd((b, 1, n)), rnd((b, 1, n)))

            def f(x, conv_state, weight, state, dt, a, bm, cm):
                return xla_ssm.mamba_decode_step(x, conv_state, weight, state, dt, a, bm, cm, dt_softplus=True)

            return jax.jit(f), args
        if op == "decode_b256":
            b, d, n = 256, 5120, 16
            args = (jnp.zeros((b, d, n), f32), rnd((b, d)), rnd((b, d)), -jnp.exp(rnd((d, n), f32, 0.5)),
                    rnd((b, 1, n)), rnd((b, 1, n)))
            return jax.jit(lambda st, *a: xla_ssm.selective_state_update(st, *a, dt_softplus=True)), args
        if op == "conv1d":
            x, w = rnd((8, 4096, 2048)), rnd((4096, 4))

            def f(x, w):
                out, pull = jax.vjp(lambda x, w: xla_ssm.causal_conv1d(x, w, activation="silu"), x, w)
                return out, pull(out)

            return jax.jit(f), (x, w)
        raise SystemExit(f"unknown op {op}")

    def checksum(tree):
        leaves = jax.tree_util.tree_leaves(tree)
        return float(sum(np.float64(jnp.sum(jnp.abs(x.astype(f32)))) for x in leaves))

    results = {}
    for op in ops:
        f, args = build(op)
        out = jax.block_until_ready(f(*args))
        total = checksum(out)
        trials = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                out = f(*args)
            jax.block_until_ready(out)
            trials.append((time.perf_counter() - t0) / reps)
        results[op] = (statistics.median(trials), total)
    with open(out_path, "w") as fh:
        json.dump(results, fh)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    ops = a.ops.split(",")
    if a.worker:
        worker(ops, a.reps, a.worker)
        return
    times = {lib: {op: [] for op in ops} for lib in ("old", "new")}
    sums = {}
    for r in range(a.rounds):
        for lib in (("old", "new") if r % 2 == 0 else ("new", "old")):
            path = a.old if lib == "old" else a.new
            out = f"/tmp/compare_{lib}_{r}.json"
            env = dict(os.environ, XLA_SSM_LIBRARY=os.path.abspath(path))
            subprocess.run([sys.executable, __file__, a.old, a.new, "--worker", out, "--reps", str(a.reps),
                            "--ops", a.ops], env=env, check=True)
            with open(out) as fh:
                for op, (t, total) in json.load(fh).items():
                    times[lib][op].append(t)
                    sums.setdefault(op, {})[lib] = total
    print(f"{'op':18} {'old us':>9} {'new us':>9} {'new/old':>8}  outputs   what")
    worst = 0.0
    for op in ops:
        old, new = statistics.median(times["old"][op]), statistics.median(times["new"][op])
        s_old, s_new = sums[op]["old"], sums[op]["new"]
        same = abs(s_old - s_new) <= 1e-3 * max(abs(s_old), 1e-30)
        worst = max(worst, new / old)
        print(f"{op:18} {old * 1e6:9.1f} {new * 1e6:9.1f} {new / old:8.3f}  {'same' if same else 'DIFFER'}    {OPS[op]}")
    print(f"slowest ratio new/old: {worst:.3f} (rounds: {a.rounds}, each a median of 5 trials x {a.reps} calls)")


if __name__ == "__main__":
    main()
