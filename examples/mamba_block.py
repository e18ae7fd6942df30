"""A minimal Mamba block in plain JAX (no Flax, no Optax) around `xla_ssm.selective_scan`, trained for
a few Adam steps on a toy task: reproduce the input sequence delayed by a few steps (needs memory).

    in_proj -> causal depthwise conv1d -> SiLU -> x_proj -> dt_proj -> selective scan (z gating) -> out_proj

    PYTHONPATH=bindings/python XLA_SSM_LIBRARY=target/release/libxla_ssm.so \\
        python examples/mamba_block.py [--steps 30] [--reference]

Prints the loss per step; exits 1 if it did not go down. `--reference` swaps the selective scan for
`xla_ssm.selective_scan_ref` (jax.lax.scan), for comparison.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import xla_ssm


def init_params(key, d_model=16, expand=2, d_state=8, d_conv=4, dt_rank=None):
    d_inner = expand * d_model
    dt_rank = dt_rank or math.ceil(d_model / 16)
    ks = jax.random.split(key, 6)

    def dense(k, fan_in, fan_out):
        return jax.random.normal(k, (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)

    # dt in [1e-3, 1e-1] at init, through the inverse softplus of the bias (as in Mamba).
    dt = jnp.exp(jax.random.uniform(ks[5], (d_inner,), jnp.float32, math.log(1e-3), math.log(1e-1)))
    return {
        "in_proj": dense(ks[0], d_model, 2 * d_inner),
        "conv_w": jax.random.normal(ks[1], (d_conv, d_inner), jnp.float32) / math.sqrt(d_conv),
        "conv_b": jnp.zeros((d_inner,), jnp.float32),
        "x_proj": dense(ks[2], d_inner, dt_rank + 2 * d_state),
        "dt_proj": dense(ks[3], dt_rank, d_inner),
        "dt_bias": dt + jnp.log(-jnp.expm1(-dt)),
        # S4D-real: A = -(1..d_state) per channel, kept negative through A = -exp(A_log).
        "A_log": jnp.log(jnp.broadcast_to(jnp.arange(1, d_state + 1, dtype=jnp.float32), (d_inner, d_state))),
        "D": jnp.ones((d_inner,), jnp.float32),
        "out_proj": dense(ks[4], d_inner, d_model),
    }


def causal_conv1d(x, w, b):
    """Depthwise causal conv over time: x (batch, seqlen, channels), w (width, channels)."""
    width = w.shape[0]
    xp = jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0)))
    seqlen = x.shape[1]
    return b + sum(xp[:, k : k + seqlen] * w[k] for k in range(width))


def mamba_block(params, x, scan=xla_ssm.selective_scan):
    """x: (batch, seqlen, d_model) -> (batch, seqlen, d_model). Channel-last throughout (layout "bld")."""
    d_state = params["A_log"].shape[1]
    dt_rank = params["dt_proj"].shape[0]
    xz = x @ params["in_proj"]
    u, z = jnp.split(xz, 2, axis=-1)  # (batch, seqlen, d_inner) each
    u = jax.nn.silu(causal_conv1d(u, params["conv_w"], params["conv_b"]))
    dt_low, B, C = jnp.split(u @ params["x_proj"], [dt_rank, dt_rank + d_state], axis=-1)
    delta = dt_low @ params["dt_proj"]  # the bias and softplus are applied inside the scan
    y = scan(
        u,
        delta,
        -jnp.exp(params["A_log"]),
        B[:, :, None, :],  # (batch, seqlen, groups=1, d_state)
        C[:, :, None, :],
        D=params["D"],
        z=z,
        delta_bias=params["dt_bias"],
        delta_softplus=True,
        layout="bld",
    )
    return x + y @ params["out_proj"]  # residual


def reference_scan(*args, **kwargs):
    return xla_ssm.selective_scan_ref(*args, **kwargs)[0]


def make_data(key, batch, seqlen, d_model, delay):
    x = jax.random.normal(key, (batch, seqlen, d_model), jnp.float32)
    target = jnp.pad(x, ((0, 0), (delay, 0), (0, 0)))[:, :seqlen]  # x shifted right by `delay`
    return x, target


def loss_fn(params, x, target, scan):
    return jnp.mean((mamba_block(params, x, scan) - target) ** 2)


def adam(lr, b1=0.9, b2=0.999, eps=1e-8):
    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.int32)}

    def update(grads, state, params):
        t = state["t"] + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
        scale = lr * jnp.sqrt(1 - b2**t) / (1 - b1**t)
        params = jax.tree.map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps), params, m, v)
        return params, {"m": m, "v": v, "t": t}

    return init, update


def train(steps=30, batch=4, seqlen=64, d_model=16, d_state=8, delay=3, lr=1e-2, seed=0, scan=None, log=print):
    """Returns the losses, one per step (before that step's update)."""
    scan = scan or xla_ssm.selective_scan
    kp, kd = jax.random.split(jax.random.PRNGKey(seed))
    params = init_params(kp, d_model=d_model, d_state=d_state)
    x, target = make_data(kd, batch, seqlen, d_model, delay)
    opt_init, opt_update = adam(lr)
    opt_state = opt_init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, target, scan)
        params, opt_state = opt_update(grads, opt_state, params)
        return params, opt_state, loss

    losses = []
    for i in range(steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
        log(f"step {i:3d}  loss {losses[-1]:.5f}  ({(time.perf_counter() - t0) * 1e3:.1f} ms)")
    return losses


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=64)
    p.add_argument("--d-model", type=int, default=16)
    p.add_argument("--reference", action="store_true", help="use the lax.scan reference instead of xla_ssm")
    args = p.parse_args(argv)
    scan = reference_scan if args.reference else xla_ssm.selective_scan
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; scan: {'reference' if args.reference else 'xla_ssm'}")
    losses = train(args.steps, args.batch, args.seqlen, args.d_model, scan=scan)
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    print(f"loss {first:.5f} -> {last:.5f}")
    return 0 if last < 0.9 * first else 1


if __name__ == "__main__":
    sys.exit(main())
