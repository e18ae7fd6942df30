"""The carry targets (`xla_ssm_selective_scan_carry_fwd` / `_bwd`, docs/selective_scan_carry.md)
against a plain reference that walks every step: both layouts, every dtype pair, with and without
z, delta_bias, softplus, time-varying and time-invariant C, groups, dstate past one bwd pass (16).

Each case has fast- and slow-decaying channels (the slow ones keep a term above f32's range to the
shard's end, so a row that stopped early fails), a channel with A = 0 (never decays) and, in the
fwd, a batch row whose state is 0 (stops at once). Runs on the default device: the CPU in CI, the
CUDA kernels on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from xla_ssm import _scan, _scan_seq

F32 = jnp.float32


def _case(layout, dtype, bc_dtype, has_z, has_bias, softplus, bc_rank, seqlen=700, dim=8, dstate=20, groups=2):
    rng = np.random.default_rng(seqlen + dim + dstate + has_z * 2 + has_bias * 3 + softplus * 5 + bc_rank)
    batch = 2
    # dt about 0.7 (fast: A cs passes -87 within ~150 steps) in the first half of the channels,
    # 0.003 (slow) in the second.
    slow = np.arange(dim) >= dim // 2
    delta = rng.normal(size=(batch, dim, seqlen)) * 0.3 + np.where(slow, -6.0, 0.0)[None, :, None]
    if not softplus:
        delta = np.abs(delta) * 0.1
    A = -rng.uniform(0.5, 4.0, size=(dim, dstate))
    A[1, 3] = 0.0
    C = rng.normal(size=(batch, groups, dstate, seqlen)) if bc_rank == 4 else rng.normal(size=(dim, dstate))
    out = rng.normal(size=(batch, dim, seqlen))
    z = rng.normal(size=(batch, dim, seqlen))
    bias = rng.normal(size=dim) * 0.1
    state = rng.normal(size=(batch, dim, dstate)) * 3
    state[1] = 0.0

    def x_like(v):
        v = jnp.asarray(v, F32).astype(dtype)
        return v if layout == "bdl" else jnp.swapaxes(v, 1, 2)

    Cj = jnp.asarray(C, F32).astype(bc_dtype)
    if bc_rank == 4 and layout == "bld":
        Cj = jnp.transpose(Cj, (0, 3, 1, 2))
    arrays = dict(
        out=x_like(out),
        delta=x_like(delta),
        A=jnp.asarray(A, F32),
        C=Cj,
        z=x_like(z) if has_z else None,
        bias=jnp.asarray(bias, F32) if has_bias else None,
        state=jnp.asarray(state, F32),
    )
    cfg = _scan._Cfg(
        delta_softplus=softplus,
        layout=layout,
        bc_rank=bc_rank,
        has_d=False,
        has_z=has_z,
        has_delta_bias=has_bias,
        has_initial_state=False,
        return_final_state=True,
    )
    return cfg, arrays


def _shard(cfg, a):
    u = a["out"]
    ops = [u, a["delta"], a["A"], a["C"], a["C"]] + [v for v in (a["z"], a["bias"]) if v is not None]
    return _scan_seq._Shard(cfg, ops)


def _reference(cfg, a):
    """(fwd's out, bwd's dstate with dout = out) by the definition, in f32, at every step; x-like
    arrays as (b, d, l)."""
    to_bdl = (lambda v: v) if cfg.layout == "bdl" else (lambda v: jnp.swapaxes(v, 1, 2))
    dt = to_bdl(a["delta"]).astype(F32)
    if a["bias"] is not None:
        dt = dt + a["bias"][None, :, None]
    if cfg.delta_softplus:
        dt = jax.nn.softplus(dt)
    cs = jnp.cumsum(dt, axis=2)
    w = jnp.exp(a["A"][None, :, None, :] * cs[..., None])  # (b, d, l, n)
    C = a["C"].astype(F32)
    if cfg.bc_rank == 2:
        Cl = jnp.broadcast_to(C[None, :, None, :], w.shape)
    else:
        if cfg.layout == "bld":
            C = jnp.transpose(C, (0, 2, 3, 1))  # (b, l, g, n) -> (b, g, n, l)
        Cl = jnp.repeat(jnp.swapaxes(C, 2, 3), w.shape[1] // C.shape[1], axis=1)  # (b, d, l, n)
    gate = jax.nn.silu(to_bdl(a["z"]).astype(F32)) if a["z"] is not None else 1.0
    x = to_bdl(a["out"]).astype(F32)
    out = x + gate * jnp.einsum("bdln,bdn->bdl", Cl * w, a["state"])
    dstate = jnp.einsum("bdl,bdln->bdn", x * gate, Cl * w)
    return to_bdl(out), dstate


_TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


@pytest.mark.parametrize("layout", ["bdl", "bld"])
@pytest.mark.parametrize(
    "dtype,bc_dtype",
    [(F32, F32), (jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, F32), (jnp.float16, jnp.float16), (jnp.float16, F32)],
)
def test_matches_reference(layout, dtype, bc_dtype):
    # Segments of 1024 (one), of 64 (the last of 60 steps), of 33 (not whole vectors of steps).
    cases = [(True, True, True, 4, 1024), (False, False, True, 2, 64), (True, False, False, 4, 33)]
    for has_z, has_bias, softplus, bc_rank, seg in cases:
        cfg, a = _case(layout, dtype, bc_dtype, has_z, has_bias, softplus, bc_rank)
        s = _shard(cfg, a)
        sums = s.interval_sums(seg)
        out = jax.jit(s.add_carried, static_argnums=3)(a["out"], a["state"], sums, seg)
        dstate = jax.jit(s.pull, static_argnums=2)(a["out"], sums, seg)
        want_out, want_dstate = _reference(cfg, a)
        # The result is rounded to the dtype: compare against the reference rounded the same way.
        want_out = want_out.astype(dtype).astype(F32)
        tol = _TOL[dtype]
        what = f"{cfg.layout} {jnp.dtype(dtype).name}/{jnp.dtype(bc_dtype).name} z={has_z} bias={has_bias} softplus={softplus} C rank {bc_rank} segments of {seg}"
        np.testing.assert_allclose(np.asarray(out, np.float32), want_out, rtol=tol, atol=tol, err_msg=what)
        scale = float(jnp.max(jnp.abs(want_dstate)))
        np.testing.assert_allclose(dstate, want_dstate, rtol=tol, atol=tol * scale * 1e-2, err_msg=what)


def test_slow_channels_keep_their_terms():
    """The reference's carried terms in the slow channels are far from zero at the shard's end, so a
    row that stopped there early would miss them (what makes the test above able to fail)."""
    cfg, a = _case("bdl", F32, F32, True, True, True, 4)
    out, _ = _reference(cfg, a)
    added = jnp.abs(out - a["out"])[:, :, -32:]
    dim = added.shape[1]
    assert float(jnp.min(jnp.max(added[0, dim // 2 :], axis=-1))) > 1e-3
    fast = [d for d in range(dim // 2) if d != 1]  # channel 1 has a state with A = 0: never decays
    assert float(jnp.max(added[0, jnp.array(fast)])) == 0.0  # the fast ones have decayed to nothing


def test_empty_and_single_step():
    for seqlen in (0, 1, 33):
        cfg, a = _case("bld", jnp.bfloat16, F32, True, True, True, 4, seqlen=seqlen, dstate=5)
        s = _shard(cfg, a)
        sums = s.interval_sums(16)
        out, dstate = s.add_carried(a["out"], a["state"], sums, 16), s.pull(a["out"], sums, 16)
        want_out, want_dstate = _reference(cfg, a)
        np.testing.assert_allclose(np.asarray(out, np.float32), want_out.astype(jnp.bfloat16).astype(F32), rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(dstate, want_dstate, rtol=1e-2, atol=1e-3)
