"""The selective scan over operands sharded along seqlen (docs/sharding.md), per shard, under
custom_partitioning: no device ever holds more than its shard of the sequence.

The recurrence is linear in its state: a shard scanned from a zero state differs from the true scan
only by its incoming state h_in carried forward, h_t += exp(A cs_t) h_in with cs_t the cumulative dt
of the shard up to step t. So each device
  1. records what each chunk of its shard hands on from a zero state, and its sum of dt
     (`xla_ssm_selective_scan_chunk_records`: the CUDA forward's first pass, over every chunk);
  2. folds them into its shard's end state from zero and decay exp(A cs_end) (small: a record per
     chunk and channel);
  3. all-gathers every shard's (decay, end state): (shards, batch, dim, dstate) f32, and forms its
     h_in from the shards before it, and the true final state from all of them;
  4. runs the library's forward on its shard from h_in, given the records: the forward's first
     pass is the one of step 1, so a shard costs about one forward of its length, and its outputs
     and checkpoints need no correction.
Where the forward would not split a shard (the CPU; a shard that already fills the GPU), step 1
would cost a scan, so the shard is scanned from zero instead, the same summaries (from its end
state and its dt sums) are exchanged, and C_t . exp(A cs_t) h_in (times silu(z)) is added to its
outputs (`xla_ssm_selective_scan_carry_fwd`, in place: each channel stops where the carried state
has decayed below f32's range) and exp(A cs) h_in to its checkpoints.
The backward mirrors it: each shard's outputs pull on its h_in by r = sum_t gy_t C_t exp(A cs_t)
(gy: dout through the gate; `xla_ssm_selective_scan_carry_bwd`), the shards' (decay, r) are
all-gathered, each device forms the gradient arriving at its end state from the shards after it,
and runs the library's backward from its true h_in (its first checkpoint) with that gradient as
dfinal_state. Per-channel gradients (A, D, delta_bias, time-invariant B/C) are then partial sums
over the shards: the caller psums them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _lib
from ._selective_scan import _softplus

_F32 = jnp.float32
RECORDS = "xla_ssm_selective_scan_chunk_records"
# Where the forward splits a shard's sequence, so that its first pass can come before the exchange
# (jax's platform name for CUDA devices). The tests add "cpu" to run that way on host devices.
RECORDS_PLATFORMS = ("gpu",)
CARRY_FWD = "xla_ssm_selective_scan_carry_fwd"
CARRY_BWD = "xla_ssm_selective_scan_carry_bwd"
# Steps a warp of the carry kernels takes on (a segment): a slowly decaying channel's steps run in
# parallel; a multiple of every checkpoint length up to 1024 that is a power of two.
SEGMENT_LEN = 1024


class _Shard:
    """One shard's operands: x-like arrays are (b, d, l) ("bdl") or (b, l, d)."""

    def __init__(self, cfg, ops):
        self.cfg = cfg
        self.bdl = cfg.layout == "bdl"
        it = iter(ops)
        self.u, self.delta, self.A, self.B, self.C = (next(it) for _ in range(5))
        self.D = next(it) if cfg.has_d else None
        self.z = next(it) if cfg.has_z else None
        self.bias = next(it) if cfg.has_delta_bias else None
        self.h0 = next(it) if cfg.has_initial_state else None
        self.plain = list(ops[: 5 + cfg.has_d + cfg.has_z + cfg.has_delta_bias])  # the operands but h0

    def dt(self):
        """dt after bias and softplus, (b, d, l) f32 whatever the layout."""
        dt = self.delta.astype(_F32)
        if self.bias is not None:
            dt = dt + self.bias.reshape((1, -1, 1) if self.bdl else (1, 1, -1))
        dt = _softplus(dt) if self.cfg.delta_softplus else dt
        return dt if self.bdl else jnp.swapaxes(dt, 1, 2)

    def interval_sums(self, n):
        """The sums of dt over intervals of n steps (the last may be shorter): (b, d, ceil(l / n))."""
        return _regroup(self.dt(), n)

    def chunk_records(self, platform):
        """chunk_records of this shard on devices of `platform`; None where the forward would not
        split it: the CPU never does, nor CUDA a shard of one chunk. Their first pass would then
        cost a scan, where the carry costs what the decay leaves of one."""
        if platform not in RECORDS_PLATFORMS or records_count(self.cfg, self.u, self.A) <= 1:
            return None
        return chunk_records(self.cfg, self.u, self.delta, self.A, self.B, self.bias)

    def _carry_call(self, target, result, first, dt_sums, segment_len, *extra):
        """The carry target on (first, delta, A, C[, z][, delta_bias], *extra, dt_sums)."""
        ops = [first, self.delta, self.A, self.C] + [v for v in (self.z, self.bias) if v is not None]
        attrs = dict(
            layout=self.cfg.layout,
            delta_softplus=np.bool_(self.cfg.delta_softplus),
            has_z=np.bool_(self.cfg.has_z),
            has_delta_bias=np.bool_(self.cfg.has_delta_bias),
            segment_len=np.int64(segment_len),
        )
        aliases = {0: 0} if target == CARRY_FWD else {}
        _lib.require(target)
        return jax.ffi.ffi_call(target, result, input_output_aliases=aliases)(*ops, *extra, dt_sums, **attrs)

    def add_carried(self, out, h, dt_sums, segment_len=SEGMENT_LEN):
        """The shard's outputs from a zero state `out` plus what a state h (batch, dim, dstate)
        entering the shard adds to them: C_t . exp(A cs_t) h, through the gate. `dt_sums`:
        interval_sums(segment_len)."""
        result = jax.ShapeDtypeStruct(out.shape, out.dtype)
        return self._carry_call(CARRY_FWD, result, out, dt_sums, segment_len, h)

    def pull(self, dout, dt_sums, segment_len=SEGMENT_LEN):
        """sum_t gy_t C_t[n] exp(A[:, n] cs_t), gy = dout through the gate: how the outputs'
        gradient reaches the state entering the shard, (batch, dim, dstate) f32."""
        batch, dim, dstate = self.u.shape[0], self.A.shape[0], self.A.shape[1]
        result = jax.ShapeDtypeStruct((batch, dim, dt_sums.shape[2], dstate), _F32)
        return self._carry_call(CARRY_BWD, result, dout, dt_sums, segment_len).sum(axis=2)

    def decay(self, dt_sums):
        """exp(A cs_end): the whole shard's decay, (batch, dim, dstate), from its dt's interval sums."""
        return jnp.exp(self.A[None] * dt_sums.sum(axis=-1)[..., None])


def records_count(cfg, u, A):
    """Chunks of the records of a shard: the CUDA forward's split of it (1: none)."""
    batch, dim, seqlen = (u.shape if cfg.layout == "bdl" else (u.shape[0], u.shape[2], u.shape[1]))
    return _lib.size("xla_ssm_selective_scan_chunk_records_count", batch, dim, seqlen, A.shape[1])


def chunk_records(cfg, u, delta, A, B, delta_bias=None):
    """Each chunk's end state from zero and sum of dt (`xla_ssm_selective_scan_chunk_records`,
    docs/selective_scan_fwd.md, "Chunk records"): (n_chunks, batch, dim, record_floats) f32."""
    floats = _lib.size("xla_ssm_selective_scan_chunk_record_floats", A.shape[1])
    result = jax.ShapeDtypeStruct((records_count(cfg, u, A), u.shape[0], A.shape[0], floats), _F32)
    attrs = dict(
        layout=cfg.layout,
        delta_softplus=np.bool_(cfg.delta_softplus),
        has_delta_bias=np.bool_(delta_bias is not None),
    )
    _lib.require(RECORDS)
    ops = [u, delta, A, B] + ([delta_bias] if delta_bias is not None else [])
    return jax.ffi.ffi_call(RECORDS, result)(*ops, **attrs)


def fold_records(records, A):
    """The shard's end state from zero and its decay exp(A cs_end), (batch, dim, dstate) each, from
    its chunk records: end = sum_k exp(A (dt after chunk k)) end_k."""
    dstate = A.shape[1]
    sums = records[..., -1]  # (n_chunks, batch, dim)
    after = jnp.cumsum(sums[::-1], axis=0)[::-1] - sums
    end = jnp.sum(jnp.exp(A * after[..., None]) * records[..., :dstate], axis=0)
    return jnp.exp(A * sums.sum(axis=0)[..., None]), end


def _regroup(x, n):
    """Sums of n consecutive entries along the last axis of (b, d, k), zero-padded: (b, d, ceil(k / n))."""
    x = jnp.pad(x, ((0, 0), (0, 0), (0, -x.shape[-1] % n)))
    return x.reshape(*x.shape[:2], -1, n).sum(-1)


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
    """The per-shard function of `call` with seqlen sharded over mesh axes `axes`; `raw(call, ops,
    chunk_records=None)` makes one FFI call."""
    shards = math.prod(mesh.shape[a] for a in axes)
    cfg = call.cfg
    platform = mesh.devices.flat[0].platform

    def fwd(*ops):
        s = _Shard(cfg, ops)
        records = s.chunk_records(platform)
        if records is not None:  # the forward splits the shard: its first pass comes first
            h_in, h = carry_in(*fold_records(records, s.A), s.h0, axes, shards)
            local = call._replace(cfg=cfg._replace(has_initial_state=True))
            res = raw(local, [*s.plain, h_in], records)
            return (res[0], h, *res[2:])
        local = call._replace(cfg=cfg._replace(has_initial_state=False))
        res = raw(local, s.plain)
        out, end = res[0], res[1]
        if not call.checkpoint_len:
            sums = s.interval_sums(SEGMENT_LEN)
            h_in, h = carry_in(s.decay(sums), end, s.h0, axes, shards)
            return s.add_carried(out, h_in, sums), h
        ckpt, length = res[2], call.checkpoint_len
        per_checkpoint = s.interval_sums(length)
        if SEGMENT_LEN % length == 0:  # one pass over dt for both
            sums = _regroup(per_checkpoint, SEGMENT_LEN // length)
        else:
            sums = s.interval_sums(SEGMENT_LEN)
        h_in, h = carry_in(s.decay(sums), end, s.h0, axes, shards)
        before = jnp.cumsum(per_checkpoint, axis=-1) - per_checkpoint  # cs before each checkpoint
        decays = jnp.exp(s.A[None, :, None, :] * before[..., None])  # (b, d, K, n)
        return s.add_carried(out, h_in, sums), h, ckpt + decays * h_in[:, :, None, :]

    def bwd(*ops):
        n = 5 + cfg.has_d + cfg.has_z + cfg.has_delta_bias + cfg.has_initial_state
        s = _Shard(cfg, ops[:n])
        ckpt, dout = ops[n], ops[n + 1]
        dfinal = ops[n + 2] if call.has_dfinal_state else None
        h_in = ckpt[:, :, 0, :]  # the forward's checkpoint 0: the true state entering this shard
        sums = s.interval_sums(SEGMENT_LEN)
        g_end, g = carry_back(s.decay(sums), s.pull(dout, sums), dfinal, axes, shards)
        local = call._replace(cfg=cfg._replace(has_initial_state=True), has_dfinal_state=True)
        grads = raw(local, [*s.plain, h_in, ckpt, dout, g_end])
        return (*grads[:-1], g) if cfg.has_initial_state else tuple(grads[:-1])

    return fwd if call.kind == "fwd" else bwd
