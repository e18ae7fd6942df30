"""SSD over operands sharded along seqlen (docs/sharding.md), per shard, under custom_partitioning:
the method of _scan_seq with SSD's per-head scalar decay, which makes both corrections matrix
products. A state S_in (batch, heads, headdim, dstate) entering the shard reaches step t as
exp(A_h cs_t) S_in (cs: the shard's cumulative dt'), so y_t gains exp(A_h cs_t) S_in C_t (times
silu(z)) and each saved chunk state gains exp(A_h cs) S_in at its chunk's start; in the backward, the
shard's outputs pull on S_in by sum_t exp(A_h cs_t) gy_t C_t^T.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ._scan_seq import carry_back, carry_in
from ._selective_scan import _softplus

_F32 = jnp.float32


class _Shard:
    """One shard's operands: x, z (b, l, h, p); dt (b, l, h); B, C (b, l, g, n)."""

    def __init__(self, cfg, ops):
        it = iter(ops)
        self.x, self.dt, self.A, self.B, self.C = (next(it) for _ in range(5))
        self.D = next(it) if cfg.d_rank else None
        self.z = next(it) if cfg.has_z else None
        self.bias = next(it) if cfg.has_dt_bias else None
        self.h0 = next(it) if cfg.has_initial_states else None
        self.plain = list(ops[: 5 + (cfg.d_rank > 0) + cfg.has_z + cfg.has_dt_bias])  # the operands but h0
        dt = self.dt.astype(_F32)
        if self.bias is not None:
            dt = dt + self.bias
        dt = _softplus(dt) if cfg.dt_softplus else dt
        dt = jnp.clip(dt, cfg.dt_min, cfg.dt_max)
        self.cs = jnp.cumsum(dt, axis=1)  # (b, l, h)
        self.heads, self.groups = self.x.shape[2], self.B.shape[2]

    def by_group(self, v, axis):
        """Split `axis` (heads) into (groups, heads per group)."""
        return v.reshape(*v.shape[:axis], self.groups, self.heads // self.groups, *v.shape[axis + 1 :])

    def carried(self):
        """exp(A_h cs_t): how the state entering the shard reaches step t, (b, l, h)."""
        return jnp.exp(self.A * self.cs)

    def decay(self):
        """exp(A_h cs_end), broadcast over a state: (b, h, 1, 1)."""
        return jnp.exp(self.A * self.cs[:, -1])[:, :, None, None]

    def gate(self):
        if self.z is None:
            return 1.0
        z = self.z.astype(_F32)
        return z * jax.nn.sigmoid(z)

    def from_state(self, s):
        """exp(A_h cs_t) C_t . S (b, l, h, p) from a state S (b, h, p, n)."""
        y = jnp.einsum("blgn,bgepn->blgep", self.C.astype(_F32), self.by_group(s, 1))
        return y.reshape(*y.shape[:2], self.heads, -1) * self.carried()[..., None]

    def pull(self, gy):
        """sum_t exp(A_h cs_t) gy_t C_t^T: the outputs' gradient reaching S_in, (b, h, p, n)."""
        w = self.by_group(gy * self.carried()[..., None], 2)  # (b, l, g, e, p)
        r = jnp.einsum("blgep,blgn->bgepn", w, self.C.astype(_F32))
        return r.reshape(r.shape[0], self.heads, *r.shape[3:])

    def chunk_decay(self, n_chunks, chunk_size):
        """exp(A_h cs) at the step before each chunk (1 at the shard's start): (b, h, 1, K, 1)."""
        at = jnp.arange(n_chunks) * chunk_size - 1
        cs = jnp.where((at >= 0)[None, :, None], jnp.take(self.cs, jnp.maximum(at, 0), axis=1), 0.0)  # (b, K, h)
        return jnp.exp(self.A * cs).transpose(0, 2, 1)[:, :, None, :, None]


def lower(call, axes, mesh, raw):
    """The per-shard function of `call` with seqlen sharded over mesh axes `axes`."""
    shards = math.prod(mesh.shape[a] for a in axes)
    cfg = call.cfg

    def fwd(*ops):
        s = _Shard(cfg, ops)
        res = raw(call._replace(cfg=cfg._replace(has_initial_states=False)), *s.plain)
        y, end = res[0], res[1]
        h_in, h = carry_in(s.decay(), end, s.h0, axes, shards)
        y = (y.astype(_F32) + s.from_state(h_in) * s.gate()).astype(y.dtype)
        if not call.save_chunk_states:
            return y, h
        chunks = res[2]
        fixed = chunks.astype(_F32) + s.chunk_decay(chunks.shape[3], cfg.chunk_size) * h_in[:, :, :, None, :]
        return y, h, fixed.astype(chunks.dtype)

    def bwd(*ops):
        n = 5 + (cfg.d_rank > 0) + cfg.has_z + cfg.has_dt_bias + cfg.has_initial_states
        s = _Shard(cfg, ops[:n])
        chunks, dy = ops[n], ops[n + 1]
        dfinal = ops[n + 2] if call.has_dfinal_states else None
        h_in = chunks[:, :, :, 0, :].astype(_F32)  # the forward's first chunk state: S entering the shard
        pull = s.pull(dy.astype(_F32) * s.gate())
        g_end, g = carry_back(s.decay(), pull, dfinal, axes, shards)
        local = call._replace(cfg=cfg._replace(has_initial_states=True), has_dfinal_states=True)
        grads = raw(local, *s.plain, h_in, chunks, dy, g_end)
        return (*grads[:-1], g) if cfg.has_initial_states else tuple(grads[:-1])

    return fwd if call.kind == "fwd" else bwd
