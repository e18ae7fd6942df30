"""Mamba-1 selective scan through libxla_ssm from JAX: check it against jax.lax.scan, time both.

Runs on the GPU when jax has one (bf16 u/delta/z/B/C, batch 8, dim 4096, seqlen 2048, dstate 16),
else on the CPU (float32, batch 2, dim 256, seqlen 512, dstate 16). Options: D, z, delta_bias and
softplus on. Exits 1 when the results disagree.

    XLA_SSM_LIBRARY=target/release/libxla_ssm.so PYTHONPATH=bindings/python \
        python examples/selective_scan_demo.py [--cpu] [--dtype bf16] [--shape 2,256,512,16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import xla_ssm

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# Allowed relative L2 error of `out`: both sides accumulate in f32 from the same inputs, so
# what is left is rounding of the output (half types) and summation order (f32).
TOL = {"f32": 1e-4, "bf16": 1e-2, "f16": 3e-3}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    p.add_argument("--dtype", choices=DTYPES, help="dtype of u, delta, z, B, C (default: bf16 on GPU, f32 on CPU)")
    p.add_argument("--shape", help="batch,dim,seqlen,dstate (default depends on the device)")
    p.add_argument("--runs", type=int, help="timed runs per implementation (median is reported)")
    return p.parse_args()


def make_inputs(key, batch, dim, seqlen, dstate, dtype):
    """Mamba-like inputs: S4D-real A, dt_bias = softplus^-1 of dt in [1e-3, 1e-1]."""
    ks = jax.random.split(key, 7)
    u = jax.random.normal(ks[0], (batch, dim, seqlen), jnp.float32).astype(dtype)
    delta = (0.5 * jax.random.normal(ks[1], (batch, dim, seqlen), jnp.float32)).astype(dtype)
    A = -jnp.broadcast_to(jnp.arange(1, dstate + 1, dtype=jnp.float32), (dim, dstate))
    B = jax.random.normal(ks[2], (batch, 1, dstate, seqlen), jnp.float32).astype(dtype)
    C = jax.random.normal(ks[3], (batch, 1, dstate, seqlen), jnp.float32).astype(dtype)
    D = jnp.ones((dim,), jnp.float32)
    z = jax.random.normal(ks[4], (batch, dim, seqlen), jnp.float32).astype(dtype)
    dt = jnp.exp(jax.random.uniform(ks[5], (dim,), jnp.float32, np.log(1e-3), np.log(1e-1)))
    delta_bias = dt + jnp.log(-jnp.expm1(-dt))  # inverse softplus
    return dict(u=u, delta=delta, A=jnp.asarray(A), B=B, C=C, D=D, z=z, delta_bias=delta_bias)


def median_time(f, args, runs, warmup=2):
    for _ in range(warmup):
        jax.block_until_ready(f(**args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(f(**args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel_l2(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    if want.size == 0:
        return 0.0
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def fmt_time(s):
    return f"{s * 1e6:9.0f} us" if s < 1e-2 else f"{s * 1e3:9.2f} ms"


def main():
    args = parse_args()
    gpus = [] if args.cpu else [d for d in jax.devices() if d.platform == "gpu"]
    device = gpus[0] if gpus else jax.devices("cpu")[0]
    on_gpu = bool(gpus)
    dtype_name = args.dtype or ("bf16" if on_gpu else "f32")
    dtype = DTYPES[dtype_name]
    if args.shape:
        batch, dim, seqlen, dstate = (int(x) for x in args.shape.split(","))
    else:
        batch, dim, seqlen, dstate = (8, 4096, 2048, 16) if on_gpu else (2, 256, 512, 16)
    runs = args.runs or (20 if on_gpu else 5)

    lib_path = xla_ssm.library_path()
    xla_ssm.load()
    print(f"library : {lib_path} (targets registered for {', '.join(xla_ssm.registered_platforms())})")
    print(f"device  : {device.platform} ({device.device_kind})")
    print(
        f"problem : batch {batch}, dim {dim}, seqlen {seqlen}, dstate {dstate}, groups 1; "
        f"u/delta/z/B/C {jnp.dtype(dtype).name}, A/D/delta_bias f32; D, z, delta_bias, softplus on"
    )

    with jax.default_device(device):
        inputs = jax.device_put(make_inputs(jax.random.PRNGKey(0), batch, dim, seqlen, dstate, dtype), device)
        ours = jax.jit(lambda **kw: xla_ssm.selective_scan_fwd(**kw, delta_softplus=True))
        ref = jax.jit(lambda **kw: xla_ssm.selective_scan_ref(**kw, delta_softplus=True))

        out, state = jax.block_until_ready(ours(**inputs))
        out_ref, state_ref = jax.block_until_ready(ref(**inputs))
        err_out, err_state = rel_l2(out, out_ref), rel_l2(state, state_ref)
        tol = TOL[dtype_name]
        ok = err_out <= tol and err_state <= tol
        print(
            f"check   : relative L2 error out {err_out:.2e}, final_state {err_state:.2e} "
            f"(tolerance {tol:.0e}) -> {'OK' if ok else 'FAILED'}"
        )

        t_ours = median_time(ours, inputs, runs)
        t_ref = median_time(ref, inputs, runs)

    print()
    print(f"| implementation ({device.platform}, median of {runs}) | time | speedup |")
    print("|---|---:|---:|")
    print(f"| xla_ssm selective_scan_fwd (FFI) | {fmt_time(t_ours)} | {t_ref / t_ours:6.1f}x |")
    print(f"| jax.lax.scan reference | {fmt_time(t_ref)} | {1.0:6.1f}x |")
    if not ok:
        print("\nFAILED: xla_ssm disagrees with the lax.scan reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
