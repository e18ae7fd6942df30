"""Forward and jax.vjp medians (us) of `xla_ssm.ssd` through jax.jit at the shapes whose batch x heads
is too small to fill a GPU (the sequence split) and at the main one: bf16, D, dt_bias, softplus,
chunk 256. For comparing two libraries on a GPU machine, run alternately:

    XLA_SSM_LIBRARY=<lib> PYTHONPATH=bindings/python python3 bench/ssd_split_time.py <label>

Prints one line: the label, then `shape fwd/vjp` per shape. No correctness check (bench_ssd.py has it).
"""

import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import xla_ssm

SHAPES = ((1, 16384, 64, 64, 128), (2, 8192, 64, 64, 128), (1, 4096, 64, 64, 128), (8, 2048, 64, 64, 128))


def inputs(b, l, h, p, n):
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    dt0 = jnp.exp(jax.random.uniform(k[0], (h,), jnp.float32, math.log(1e-3), math.log(1e-1)))
    return (
        jax.random.normal(k[1], (b, l, h, p)).astype(jnp.bfloat16),
        (0.5 * jax.random.normal(k[2], (b, l, h))).astype(jnp.bfloat16),
        -jax.random.uniform(k[3], (h,), jnp.float32, 1.0, 16.0),
        jax.random.normal(k[4], (b, l, 1, n)).astype(jnp.bfloat16),
        jax.random.normal(k[5], (b, l, 1, n)).astype(jnp.bfloat16),
        jnp.ones((h,)),
        dt0 + jnp.log(-jnp.expm1(-dt0)),  # dt_bias: softplus^-1 of dt in [1e-3, 1e-1]
    )


def ssd(x, dt, A, B, C, D, dt_bias):
    return xla_ssm.ssd(x, dt, A, B, C, chunk_size=256, D=D, dt_bias=dt_bias, dt_softplus=True)


def step(args, dy):
    y, pull = jax.vjp(lambda a: ssd(*a), args)
    return y, pull(dy)


def median_us(fn, *args, calls=10, reps=15):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            r = fn(*args)
        jax.block_until_ready(r)
        times.append((time.perf_counter() - t) / calls * 1e6)
    return float(np.median(times))


def main():
    fwd, vjp = jax.jit(ssd), jax.jit(step)
    cells = []
    for shape in SHAPES:
        args = inputs(*shape)
        cells.append(f"{'x'.join(map(str, shape))} {median_us(fwd, *args):.0f}/{median_us(vjp, args, args[0]):.0f}")
    print(sys.argv[1] if len(sys.argv) > 1 else "ours", " | ".join(cells))


if __name__ == "__main__":
    main()
