"""The selective scan over operands sharded along seqlen (docs/sharding.md), per shard, under
custom_partitioning: no device ever holds more than its shard of the sequence.

The recurrence is linear in its state: a shard scanned from a zero state differs from the true scan
only by its incoming state h_in carried forward, h_t += exp(A cs_t) h_in with cs_t the cumulative dt
of the shard up to step t. So each device
  1. scans its shard from zero (the library's forward): outputs, end state, checkpoints;
  2. all-gathers every shard's (decay exp(A cs_end), end state): (shards, batch, dim, dstate) f32;
  3. forms its h_in from the shards before it, and the true final state from all of them;
  4. adds C_t . exp(A cs_t) h_in (times silu(z)) to its outputs and exp(A cs) h_in to its
     checkpoints, as dstate fused elementwise terms (no rescan).
The backward mirrors it: each shard's outputs pull on its h_in by r = sum_t gy_t C_t exp(A cs_t)
(gy: dout through the gate), the shards' (decay, r) are all-gathered, each device forms the gradient
arriving at its end state from the shards after it, and runs the library's backward from its true
h_in (its first checkpoint) with that gradient as dfinal_state. Per-channel gradients (A, D,
delta_bias, time-invariant B/C) are then partial sums over the shards: the caller psums them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ._selective_scan import _softplus

_F32 = jnp.float32


class _Shard:
    """One shard's arrays in the layout's axes: x-like arrays are (b, d, l) ("bdl") or (b, l, d)."""

    def __init__(self, cfg, ops):
        self.cfg = cfg
        self.bdl = cfg.layout == "bdl"
        self.l_axis, self.d_axis = (2, 1) if self.bdl else (1, 2)
        it = iter(ops)
        self.u, self.delta, self.A, self.B, self.C = (next(it) for _ in range(5))
        self.D = next(it) if cfg.has_d else None
        self.z = next(it) if cfg.has_z else None
        self.bias = next(it) if cfg.has_delta_bias else None
        self.h0 = next(it) if cfg.has_initial_state else None
        self.plain = list(ops[: 5 + cfg.has_d + cfg.has_z + cfg.has_delta_bias])  # the operands but h0
        dt = self.delta.astype(_F32)
        if self.bias is not None:
            dt = dt + self.channel(self.bias)
        dt = _softplus(dt) if cfg.delta_softplus else dt
        self.cs = jnp.cumsum(dt, axis=self.l_axis)  # cs_t: sum of dt over the shard's steps 0..t

    def channel(self, v):
        """A (dim,) vector broadcast over an x-like array."""
        return v.reshape((1, -1, 1) if self.bdl else (1, 1, -1))

    def per_channel(self, v):
        """(batch, dim) -> broadcast over x-like arrays."""
        return v[:, :, None] if self.bdl else v[:, None, :]

    def c_state(self, n):
        """C's state n for each channel at each step: x-like (time-invariant C: (1, dim) broadcast)."""
        C = self.C.astype(_F32)
        if self.cfg.bc_rank == 2:
            return self.channel(C[:, n])
        dim = self.u.shape[self.d_axis]
        if self.bdl:  # (b, g, n, l) -> (b, d, l)
            return jnp.repeat(C[:, :, n, :], dim // C.shape[1], axis=1)
        return jnp.repeat(C[:, :, :, n], dim // C.shape[2], axis=2)  # (b, l, g, n) -> (b, l, d)

    def carried(self, n):
        """exp(A[:, n] cs_t): how state n entering the shard reaches step t, x-like."""
        return jnp.exp(self.channel(self.A[:, n]) * self.cs)

    # The two per-state sums below are written as dstate elementwise terms over x-like arrays, which
    # XLA fuses into passes along the shard's contiguous axis. Written as a reduction over a trailing
    # dstate axis of (x-like, dstate) products, the 2-GPU forward at 1 x 4096 x 131072 x 16 took
    # 12.7 ms rather than 7.3 (H200; BENCHMARKS.md, "Seqlen sharding").

    def from_state(self, h):
        """sum_n C_t[n] exp(A[:, n] cs_t) h[:, :, n]: what a state h entering the shard adds to its
        outputs before the gate, x-like f32."""
        return sum(self.c_state(n) * self.carried(n) * self.per_channel(h[:, :, n]) for n in range(self.A.shape[1]))

    def pull(self, gy):
        """sum_t gy_t C_t[n] exp(A[:, n] cs_t): how the outputs' gradient gy (x-like) reaches the state
        entering the shard, (batch, dim, dstate)."""
        terms = [jnp.sum(gy * self.c_state(n) * self.carried(n), axis=self.l_axis) for n in range(self.A.shape[1])]
        return jnp.stack(terms, axis=-1)

    def decay(self):
        """exp(A cs_end): the whole shard's decay, (batch, dim, dstate)."""
        end = jax.lax.index_in_dim(self.cs, self.cs.shape[self.l_axis] - 1, self.l_axis, keepdims=False)
        return jnp.exp(self.A[None] * end[..., None])

    def gate(self):
        if self.z is None:
            return 1.0
        z = self.z.astype(_F32)
        return z * jax.nn.sigmoid(z)

    def checkpoint_decay(self, n_checkpoints, checkpoint_len):
        """exp(A cs) at the step before each checkpoint (1 at the shard's start): (b, d, K, n)."""
        at = jnp.arange(n_checkpoints) * checkpoint_len - 1
        cs = jnp.take(self.cs, jnp.maximum(at, 0), axis=self.l_axis)
        cs = jnp.where((at >= 0).reshape((1, 1, -1) if self.bdl else (1, -1, 1)), cs, 0.0)
        if not self.bdl:
            cs = jnp.swapaxes(cs, 1, 2)  # (b, K, d) -> (b, d, K)
        return jnp.exp(self.A[:, None, :][None] * cs[..., None])


def carry_in(decay, end, start, axes, shards):
    """The state entering this shard and the final state, from every shard's (decay, end state
    from zero) and the state entering the first (`start`, None: zeros)."""
    decays, ends = jax.lax.all_gather(decay, axes), jax.lax.all_gather(end, axes)
    h = start if start is not None else jnp.zeros_like(end)
    entering = []
    for j in range(shards):
        entering.append(h)
        h = ends[j] + decays[j] * h
    return jnp.stack(entering)[jax.lax.axis_index(axes)], h


def carry_back(decay, pull, dfinal, axes, shards):
    """The gradient reaching this shard's end state and the one reaching the first shard's
    entering state, from every shard's (decay, pull of its outputs on its entering state) and the
    final state's gradient (None: zeros)."""
    decays, pulls = jax.lax.all_gather(decay, axes), jax.lax.all_gather(pull, axes)
    g = dfinal if dfinal is not None else jnp.zeros_like(pull)
    leaving = [None] * shards
    for j in reversed(range(shards)):
        leaving[j] = g
        g = pulls[j] + decays[j] * g
    return jnp.stack(leaving)[jax.lax.axis_index(axes)], g


def lower(call, axes, mesh, raw):
    """The per-shard function of `call` with seqlen sharded over mesh axes `axes`."""
    shards = math.prod(mesh.shape[a] for a in axes)
    cfg = call.cfg

    def fwd(*ops):
        s = _Shard(cfg, ops)
        local = call._replace(cfg=cfg._replace(has_initial_state=False))
        res = raw(local, *s.plain)
        out, end = res[0], res[1]
        h_in, h = carry_in(s.decay(), end, s.h0, axes, shards)
        out = (out.astype(_F32) + s.from_state(h_in) * s.gate()).astype(out.dtype)
        if not call.checkpoint_len:
            return out, h
        ckpt = res[2]
        ckpt = ckpt + s.checkpoint_decay(ckpt.shape[2], call.checkpoint_len) * h_in[:, :, None, :]
        return out, h, ckpt

    def bwd(*ops):
        n = 5 + cfg.has_d + cfg.has_z + cfg.has_delta_bias + cfg.has_initial_state
        s = _Shard(cfg, ops[:n])
        ckpt, dout = ops[n], ops[n + 1]
        dfinal = ops[n + 2] if call.has_dfinal_state else None
        h_in = ckpt[:, :, 0, :]  # the forward's checkpoint 0: the true state entering this shard
        gy = dout.astype(_F32) * s.gate()
        pull = s.pull(gy)
        g_end, g = carry_back(s.decay(), pull, dfinal, axes, shards)
        local = call._replace(cfg=cfg._replace(has_initial_state=True), has_dfinal_state=True)
        grads = raw(local, *s.plain, h_in, ckpt, dout, g_end)
        return (*grads[:-1], g) if cfg.has_initial_state else tuple(grads[:-1])

    return fwd if call.kind == "fwd" else bwd
