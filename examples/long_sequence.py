"""A sequence split over devices along seqlen: `selective_scan` and `ssd` under jax.jit with the
sequence sharded, forward and gradient, against the same calls on one device.

    python examples/long_sequence.py            # 8 CPU devices (set below), small sizes
    python examples/long_sequence.py --gpu      # every visible GPU, seqlen 2^17 split across them

No device holds more than its part of the sequence: each scans its shard, the shards exchange only
(batch, dim, dstate) summaries, and each corrects its outputs in closed form (docs/sharding.md).
"""

from __future__ import annotations

import os
import sys

if "--gpu" not in sys.argv:  # before jax starts: 8 host devices stand in for accelerators
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import xla_ssm  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def main():
    gpu = "--gpu" in sys.argv
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("seq",), devices=devices)
    dtype = jnp.bfloat16 if gpu else jnp.float32
    batch, dim, dstate, seqlen = (1, 1024, 16, 1 << 17) if gpu else (2, 16, 8, 2048)
    rng = np.random.default_rng(0)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731

    # Channel-last (batch, seqlen, dim) tokens, the sequence axis sharded over "seq".
    tokens = NamedSharding(mesh, P(None, "seq", None))
    bc = NamedSharding(mesh, P(None, "seq", None, None))  # B, C: (batch, seqlen, groups, dstate)
    u, delta, z = (jax.device_put(r(batch, seqlen, dim), tokens) for _ in range(3))
    B, C = (jax.device_put(r(batch, seqlen, 1, dstate), bc) for _ in range(2))
    A = -jnp.tile(jnp.arange(1, dstate + 1, dtype=jnp.float32), (dim, 1))
    D = jnp.ones(dim, jnp.float32)

    def scan(u, delta, B, C, z):
        return xla_ssm.selective_scan(u, delta, A, B, C, D=D, z=z, delta_softplus=True, layout="bld")

    loss = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(scan(*a).astype(jnp.float32) ** 2), argnums=(0, 1)))
    value, (du, ddelta) = loss(u, delta, B, C, z)
    print(f"selective_scan {batch}x{seqlen}x{dim}x{dstate} over {len(devices)} devices: loss {float(value):.6g}, "
          f"du sharded as {du.sharding.spec}")  # fmt: skip
    if not gpu:  # the same on one device
        whole = [np.asarray(a) for a in (u, delta, B, C, z)]
        want, (wdu, _) = jax.value_and_grad(lambda *a: jnp.sum(scan(*a) ** 2), argnums=(0, 1))(*whole)
        print(f"  one device: loss {float(want):.6g}, max |du difference| {float(jnp.max(jnp.abs(du - wdu))):.2e}")

    # Mamba-2's SSD: x (batch, seqlen, heads, headdim), the sequence sharded the same way.
    heads, headdim, n = (32, 64, 128) if gpu else (4, 8, 16)
    x = jax.device_put(r(batch, seqlen, heads, headdim), NamedSharding(mesh, P(None, "seq", None, None)))
    dt = jax.device_put(r(batch, seqlen, heads), NamedSharding(mesh, P(None, "seq", None)))
    Bs, Cs = (jax.device_put(r(batch, seqlen, 1, n), bc) for _ in range(2))
    A2 = -jnp.linspace(1.0, 8.0, heads, dtype=jnp.float32)
    y, states = jax.jit(lambda *a: xla_ssm.ssd(*a, chunk_size=64, dt_softplus=True, return_final_states=True))(
        x, dt, A2, Bs, Cs
    )
    print(f"ssd {batch}x{seqlen}x{heads}x{headdim}x{n}: y sharded as {y.sharding.spec}, final states {states.shape}")


if __name__ == "__main__":
    main()
