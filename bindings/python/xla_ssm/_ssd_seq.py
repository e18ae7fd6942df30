"""SSD over operands sharded along seqlen (docs/sharding.md), per shard, under custom_partitioning:
the method of _scan_seq with SSD's per-head scalar decay, which makes the summaries and the
backward's pull matrix products. A state S_in (batch, heads, headdim, dstate) entering the shard
reaches step t as exp(A_h cs_t) S_in (cs: the shard's cumulative dt'). The forward first forms the
state the shard leaves from a zero one, exchanges it, and then runs the library's forward once,
from the true S_in. On a GPU, where the tensor-core kernels run the shape as it is, that state
comes from the forward's own first pass (`xla_ssm_ssd_part_records`), whose records the forward
is then given, so the shard costs one forward; elsewhere it is sum_t exp(A_h (cs_end - cs_t)) dt'_t
x_t B_t^T, a product over the shard. In the backward, the shard's outputs pull on S_in by
sum_t exp(A_h cs_t) gy_t C_t^T.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _lib
from ._scan_seq import carry_back, carry_in
from ._selective_scan import _softplus

_F32 = jnp.float32
RECORDS = "xla_ssm_ssd_part_records"
# Where the tensor-core forward runs (jax's platform name for CUDA devices). The tests add "cpu" to
# run that way on host devices.
RECORDS_PLATFORMS = ("gpu",)


def part_records_floats(cfg, x, B):
    """f32s of the part records of these operands' shape (0: the target refuses it)."""
    batch, seqlen, heads, headdim = x.shape
    shape = (batch, seqlen, heads, headdim, B.shape[3], B.shape[2], cfg.chunk_size, _lib.dtype_code(x.dtype))
    return _lib.size("xla_ssm_ssd_part_records_floats", *shape)


def part_records(cfg, x, dt, A, B, dt_bias=None):
    """(end states from zero (batch, heads, headdim, dstate) f32, part records) of
    `xla_ssm_ssd_part_records` (docs/ssd.md, "Part records")."""
    batch, _, heads, headdim = x.shape
    results = (
        jax.ShapeDtypeStruct((batch, heads, headdim, B.shape[3]), _F32),
        jax.ShapeDtypeStruct((part_records_floats(cfg, x, B),), _F32),
    )
    attrs = dict(
        chunk_size=np.int64(cfg.chunk_size),
        dt_softplus=np.bool_(cfg.dt_softplus),
        dt_min=np.float32(cfg.dt_min),
        dt_max=np.float32(cfg.dt_max),
        has_dt_bias=np.bool_(dt_bias is not None),
    )
    _lib.require(RECORDS)
    ops = [x, dt, A, B] + ([dt_bias] if dt_bias is not None else [])
    return jax.ffi.ffi_call(RECORDS, results)(*ops, **attrs)


class _Shard:
    """One shard's operands: x, z (b, l, h, p); dt (b, l, h); B, C (b, l, g, n)."""

    def __init__(self, cfg, ops):
        self.cfg = cfg
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
        self.dt_eff = jnp.clip(dt, cfg.dt_min, cfg.dt_max)  # (b, l, h)
        self.heads, self.groups = self.x.shape[2], self.B.shape[2]

    def by_group(self, v, axis):
        """Split `axis` (heads) into (groups, heads per group)."""
        return v.reshape(*v.shape[:axis], self.groups, self.heads // self.groups, *v.shape[axis + 1 :])

    @functools.cached_property
    def cs(self):
        """The shard's cumulative dt', (b, l, h): only where a product needs every step's."""
        return jnp.cumsum(self.dt_eff, axis=1)

    def carried(self):
        """exp(A_h cs_t): how the state entering the shard reaches step t, (b, l, h)."""
        return jnp.exp(self.A * self.cs)

    def decay(self):
        """exp(A_h cs_end), broadcast over a state: (b, h, 1, 1)."""
        return jnp.exp(self.A * self.dt_eff.sum(axis=1))[:, :, None, None]  # a sum, not a cumsum's last

    def gate(self):
        if self.z is None:
            return 1.0
        z = self.z.astype(_F32)
        return z * jax.nn.sigmoid(z)

    def end_state(self):
        """The state the shard leaves from a zero one, sum_t exp(A_h (cs_end - cs_t)) dt'_t x_t B_t^T,
        (b, h, p, n) f32: a product in x's dtype with f32 sums, as the kernels form chunk states."""
        w = jnp.exp(self.A * (self.cs[:, -1:] - self.cs)) * self.dt_eff  # (b, l, h), at most dt'
        xw = (self.x.astype(_F32) * w[..., None]).astype(self.x.dtype)
        s = jnp.einsum("blgep,blgn->bgepn", self.by_group(xw, 2), self.B, preferred_element_type=_F32)
        return s.reshape(s.shape[0], self.heads, *s.shape[3:])

    def part_records(self, platform):
        """part_records of this shard on devices of `platform`; None where the forward would not
        run the shape as it is on tensor cores (or not on CUDA)."""
        if platform not in RECORDS_PLATFORMS or part_records_floats(self.cfg, self.x, self.B) == 0:
            return None
        return part_records(self.cfg, self.x, self.dt, self.A, self.B, self.bias)

    def pull(self, gy):
        """sum_t exp(A_h cs_t) gy_t C_t^T: the outputs' gradient reaching S_in, (b, h, p, n)."""
        w = self.by_group(gy * self.carried()[..., None], 2)  # (b, l, g, e, p)
        r = jnp.einsum("blgep,blgn->bgepn", w, self.C.astype(_F32))
        return r.reshape(r.shape[0], self.heads, *r.shape[3:])


def lower(call, axes, mesh, raw):
    """The per-shard function of `call` with seqlen sharded over mesh axes `axes`; `raw(call, ops,
    part_records=None)` makes one FFI call."""
    shards = math.prod(mesh.shape[a] for a in axes)
    cfg = call.cfg
    platform = mesh.devices.flat[0].platform

    def fwd(*ops):
        s = _Shard(cfg, ops)
        made = s.part_records(platform)
        end, records = made if made is not None else (s.end_state(), None)
        h_in, h = carry_in(s.decay(), end, s.h0, axes, shards)
        res = raw(call._replace(cfg=cfg._replace(has_initial_states=True)), [*s.plain, h_in], records)
        return (res[0], h, res[2]) if call.save_chunk_states else (res[0], h)

    def bwd(*ops):
        n = 5 + (cfg.d_rank > 0) + cfg.has_z + cfg.has_dt_bias + cfg.has_initial_states
        s = _Shard(cfg, ops[:n])
        chunks, dy = ops[n], ops[n + 1]
        dfinal = ops[n + 2] if call.has_dfinal_states else None
        h_in = chunks[:, :, :, 0, :].astype(_F32)  # the forward's first chunk state: S entering the shard
        pull = s.pull(dy.astype(_F32) * s.gate())
        g_end, g = carry_back(s.decay(), pull, dfinal, axes, shards)
        local = call._replace(cfg=cfg._replace(has_initial_states=True), has_dfinal_states=True)
        grads = raw(local, [*s.plain, h_in, chunks, dy, g_end])
        return (*grads[:-1], g) if cfg.has_initial_states else tuple(grads[:-1])

    return fwd if call.kind == "fwd" else bwd
