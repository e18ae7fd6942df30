"""`xla_ssm.ssd` under jax.jit with operands sharded over batch and heads (8 CPU devices, see
conftest.py): results keep the sharding, nothing big is gathered, gradients are right."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import xla_ssm
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_selective_scan_sharding import GATHER
from test_ssd_jax import ARRAYS, F32, GRAD_TOL, STATE_TOL, Y_TOL, assert_close, cotangents, loss_fn, make_case

STATIC = dict(chunk_size=32, dt_softplus=True)


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip(f"needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), have {len(devices)}")
    return Mesh(np.array(devices[:8]).reshape(2, 4), ("b", "h"))


def place(mesh, kw, bspec, hspec, gspec):
    """device_put every operand with the sharding a user would give it: batch over `bspec`, heads
    over `hspec` (B/C's groups over `gspec`), seqlen, headdim and dstate whole."""
    x = P(bspec, None, hspec, None)
    specs = {"x": x, "z": x, "dt": P(bspec, None, hspec), "A": P(hspec), "dt_bias": P(hspec), "D": P(hspec),
             "B": P(bspec, None, gspec, None), "C": P(bspec, None, gspec, None),
             "initial_states": P(bspec, hspec, None, None)}  # fmt: skip
    arrays = {k: v for k, v in kw.items() if k in ARRAYS}
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in arrays.items()}, arrays, specs


def assert_sharded(name, a, mesh, spec):
    assert a.sharding.is_equivalent_to(NamedSharding(mesh, spec), a.ndim), (name, a.sharding)


BARE = dict(d=0, z=False, bias=False, h0=False)
CASES = [  # (id, batch, groups, make_case options, batch axis, head axis, groups axis); heads = 8
    ("b-h-g1", 4, 1, dict(d=1), "b", "h", None),
    ("b-h-g4-Dchannel", 4, 4, dict(d=2), "b", "h", "h"),
    ("b-h-g4-bare", 4, 4, BARE, "b", "h", "h"),
    ("h-only-g8", 3, 8, dict(d=2), None, "h", "h"),
    ("b-only-g2", 4, 2, dict(d=1), "b", None, None),
    ("bh-over-batch", 8, 1, dict(d=1), ("b", "h"), None, None),
]
PARAMS = pytest.mark.parametrize("batch,groups,opts,bax,hax,gax", [c[1:] for c in CASES], ids=[c[0] for c in CASES])


@PARAMS
def test_sharded_forward(mesh, batch, groups, opts, bax, hax, gax):
    kw = make_case(200, batch, 37, 8, 4, 8, groups, **opts)
    placed, arrays, specs = place(mesh, kw, bax, hax, gax)
    f = jax.jit(lambda a: xla_ssm.ssd(**a, **STATIC, return_final_states=True)).lower(placed).compile()
    y, s = f(placed)
    assert_sharded("y", y, mesh, specs["x"])
    assert_sharded("final_states", s, mesh, specs["initial_states"])
    want_y, want_s = xla_ssm.ssd_ref(**arrays, **STATIC, return_final_states=True)
    assert_close("y", y, want_y, Y_TOL[F32])
    assert_close("final_states", s, want_s, STATE_TOL[F32])
    hlo = f.as_text()
    assert not GATHER.search(hlo), GATHER.search(hlo).group(0)
    assert "all-reduce" not in hlo  # the forward needs no communication at all


def sharded_grads(mesh, kw, placed, specs):
    """jax.grad of a weighted sum of y and final_states under jit, with the weights sharded like
    their primals; returns the gradients, the compiled HLO and the reference's gradients."""
    w, v = cotangents(0, kw, F32)
    w = jax.device_put(w, NamedSharding(mesh, specs["x"]))
    v = jax.device_put(v, NamedSharding(mesh, specs["initial_states"]))
    g = jax.jit(lambda a, w, v: jax.grad(loss_fn(xla_ssm.ssd, STATIC, w, v))(a)).lower(placed, w, v).compile()
    arrays = {k: kw[k] for k in placed}
    want = jax.jit(jax.grad(loss_fn(xla_ssm.ssd_ref, STATIC, np.asarray(w), np.asarray(v))))(arrays)
    return g(placed, w, v), g.as_text(), want


@PARAMS
def test_sharded_grad(mesh, batch, groups, opts, bax, hax, gax):
    """Gradients of per-head parameters sum over batch shards, of B/C over head shards when its
    groups are not split (psum); every gradient keeps its primal's sharding."""
    kw = make_case(201, batch, 70, 8, 4, 8, groups, **opts)
    placed, _, specs = place(mesh, kw, bax, hax, gax)
    ours, hlo, want = sharded_grads(mesh, kw, placed, specs)
    for k in placed:
        assert_close(f"d{k}", ours[k], want[k], GRAD_TOL[F32])
        assert_sharded(f"d{k}", ours[k], mesh, specs[k])
    assert not GATHER.search(hlo), GATHER.search(hlo).group(0)


def test_groups_not_divisible_by_head_shards(mesh):
    """groups=2 over 4 head shards: heads cannot be split into whole groups; they are gathered,
    and the results are still right."""
    kw = make_case(202, 4, 37, 8, 4, 8, 2)
    placed, arrays, _ = place(mesh, kw, "b", "h", None)
    f = jax.jit(lambda a: xla_ssm.ssd(**a, **STATIC, return_final_states=True)).lower(placed).compile()
    want_y, want_s = xla_ssm.ssd_ref(**arrays, **STATIC, return_final_states=True)
    y, s = f(placed)
    assert_close("y", y, want_y, Y_TOL[F32])
    assert_close("final_states", s, want_s, STATE_TOL[F32])
    # ...and the gather shows in the HLO: the check the other tests rely on does see one.
    assert GATHER.search(f.as_text())


def test_packed_sharded_over_heads(mesh):
    """Packed sequences (batch 1) with the heads sharded: each shard runs its heads over every
    sequence; the state rows (sequences) and the boundaries stay whole; gradients are right."""
    from test_ssd_jax import make_packed

    kw, cu = make_packed(203, [0, 9, 1, 20, 0, 40], heads=8, headdim=4, dstate=8, groups=4)
    placed, arrays, specs = place(mesh, kw, None, "h", "h")
    h0 = jax.device_put(kw["initial_states"], NamedSharding(mesh, P(None, "h", None, None)))
    placed["initial_states"] = h0
    f = jax.jit(lambda a: xla_ssm.ssd(**a, **STATIC, return_final_states=True, cu_seqlens=cu)).lower(placed).compile()
    y, s = f(placed)
    assert_sharded("y", y, mesh, specs["x"])
    assert_sharded("final_states", s, mesh, P(None, "h", None, None))
    want_y, want_s = jax.jit(lambda a: xla_ssm.ssd_ref(**a, **STATIC, return_final_states=True, cu_seqlens=cu))(arrays)
    assert_close("y", y, want_y, Y_TOL[F32])
    assert_close("final_states", s, want_s, STATE_TOL[F32])
    hlo = f.as_text()
    assert not GATHER.search(hlo), GATHER.search(hlo).group(0)

    rng = np.random.default_rng(0)
    w = rng.standard_normal(kw["x"].shape).astype(np.float32)
    v = rng.standard_normal(kw["initial_states"].shape).astype(np.float32)

    def loss(scan):
        def f(a):
            y, s = scan(**a, **STATIC, return_final_states=True, cu_seqlens=cu)
            return (y * w).sum() + (s * v).sum()

        return f

    got = jax.jit(jax.grad(loss(xla_ssm.ssd)))(placed)
    want = jax.jit(jax.grad(loss(xla_ssm.ssd_ref)))(arrays)
    for k in placed:
        assert_close(f"d{k}", got[k], want[k], GRAD_TOL[F32])
