"""`xla_ssm.selective_scan` under jax.jit with operands sharded over batch and dim (8 CPU devices,
see conftest.py): results keep the sharding, nothing big is gathered, gradients are right."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_ssm
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_selective_scan_grad import ARRAYS, GRAD_TOL, cotangents, loss_fn, ref_scan, split
from test_selective_scan_jax import F32, assert_close, make_case

GATHER = re.compile(r"\b(all-gather|all-to-all|collective-permute)(-start)?\(")


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip(f"needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), have {len(devices)}")
    return Mesh(np.array(devices[:8]).reshape(2, 4), ("b", "d"))


def place(mesh, arrays, layout, bspec, dspec, gspec):
    """device_put every operand with the sharding a user would give it: batch over `bspec`,
    dim over `dspec` (B/C's groups over `gspec`), seqlen and dstate whole."""
    x = P(bspec, dspec, None) if layout == "bdl" else P(bspec, None, dspec)
    specs = {"u": x, "delta": x, "z": x, "A": P(dspec, None), "D": P(dspec), "delta_bias": P(dspec),
             "initial_state": P(bspec, dspec, None)}
    if arrays["B"].ndim == 4:
        specs["B"] = specs["C"] = P(bspec, gspec, None, None) if layout == "bdl" else P(bspec, None, gspec, None)
    else:
        specs["B"] = specs["C"] = P(dspec, None)
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in arrays.items()}, specs


CASES = [  # (id, batch, dim, groups, B/C form, batch axis, dim axis, groups axis)
    ("b-d-g1", 4, 16, 1, "var", "b", "d", None),
    ("b-d-g4", 4, 16, 4, "var", "b", "d", "d"),
    ("b-d-inv", 4, 16, 1, "inv", "b", "d", None),
    ("d-only", 3, 8, 1, "var", None, "d", None),
    ("b-only", 2, 6, 3, "var", "b", None, None),
    ("bd-over-batch", 8, 4, 1, "var", ("b", "d"), None, None),
]


@pytest.mark.parametrize("layout", ["bdl", "bld"])
@pytest.mark.parametrize("batch,dim,groups,bc,bax,dax,gax", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_sharded_forward(mesh, batch, dim, groups, bc, bax, dax, gax, layout):
    kw = make_case(100, batch, dim, 37, 8, groups, bc=bc, layout=layout)
    arrays, static = split(kw)
    placed, specs = place(mesh, arrays, layout, bax, dax, gax)
    f = jax.jit(lambda a: xla_ssm.selective_scan(**a, **static, return_final_state=True))
    out, h = f(placed)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, specs["u"]), out.ndim), out.sharding
    assert h.sharding.is_equivalent_to(NamedSharding(mesh, specs["initial_state"]), h.ndim), h.sharding
    want_out, want_h = xla_ssm.selective_scan_ref(**arrays, **static)
    assert_close("out", out, want_out, (2e-5, 1e-4))
    assert_close("final_state", h, want_h, (2e-5, 1e-4))
    hlo = f.lower(placed).compile().as_text()
    assert not GATHER.search(hlo), GATHER.search(hlo).group(0)
    assert "all-reduce" not in hlo  # the forward needs no communication at all


def test_groups_not_divisible_by_dim_shards(mesh):
    """groups=2 over 4 dim shards: dim cannot be split by whole groups; it is gathered, and right."""
    kw = make_case(101, 2, 8, 9, 4, 2)
    arrays, static = split(kw)
    placed, _ = place(mesh, arrays, "bdl", "b", "d", None)
    f = jax.jit(lambda a: xla_ssm.selective_scan(**a, **static))
    assert_close("out", f(placed), xla_ssm.selective_scan_ref(**arrays, **static)[0], (2e-5, 1e-4))
    # ...and the gather shows in the HLO: the check the other tests rely on does see one.
    assert GATHER.search(f.lower(placed).compile().as_text())


@pytest.mark.parametrize("layout", ["bdl", "bld"])
@pytest.mark.parametrize("batch,dim,groups,bc,bax,dax,gax", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_sharded_grad(mesh, batch, dim, groups, bc, bax, dax, gax, layout):
    """Gradients of per-dim parameters sum over batch shards, of B/C over dim shards (psum)."""
    kw = make_case(102, batch, dim, 70, 8, groups, bc=bc, layout=layout)
    arrays, static = split(kw)
    placed, specs = place(mesh, arrays, layout, bax, dax, gax)
    w, v = cotangents(0, kw, F32)
    w = jax.device_put(w, NamedSharding(mesh, specs["u"]))
    v = jax.device_put(v, NamedSharding(mesh, specs["initial_state"]))
    g = jax.jit(lambda a, w, v: jax.grad(loss_fn(xla_ssm.selective_scan, static, w, v, True))(a))
    ours = g(placed, w, v)
    want = jax.grad(loss_fn(ref_scan, static, np.asarray(w), np.asarray(v), True))(arrays)
    for k in arrays:
        assert_close(f"d{k}", ours[k], want[k], GRAD_TOL[F32])
    hlo = g.lower(placed, w, v).compile().as_text()
    assert not GATHER.search(hlo), GATHER.search(hlo).group(0)
    for k in ("u", "delta", "z", "initial_state"):  # per-element gradients stay where their primal is
        assert ours[k].sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), ours[k].ndim), (k, ours[k].sharding)


def test_sharded_vmap_forward(mesh):
    """vmap inside a sharded jit: the mapped axis folds into batch, the result is still right."""
    keys = ("u", "delta", "z", "B", "C", "initial_state")
    kws = [make_case(103 + i, 4, 8, 13, 4) for i in range(2)]
    xs = {k: np.stack([kw[k] for kw in kws]) for k in keys}
    shared = {k: kws[0][k] for k in ARRAYS if k not in xs}
    xs = {k: jax.device_put(v, NamedSharding(mesh, P(None, "b"))) for k, v in xs.items()}
    out = jax.jit(jax.vmap(lambda x: xla_ssm.selective_scan(**x, **shared, delta_softplus=True)))(xs)
    for i in range(2):
        want, _ = xla_ssm.selective_scan_ref(**{k: kws[i][k] for k in keys}, **shared, delta_softplus=True)
        assert_close("out", out[i], want, (2e-5, 1e-4))
    assert jnp.shape(out) == (2, 4, 8, 13)


def test_explicit_mesh_as_in_readme():
    """jax.make_mesh (Explicit axes by default) and the shardings the README shows."""
    devices = jax.devices("cpu")[:8]
    if len(devices) < 8:
        pytest.skip("needs 8 CPU devices")
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=devices)
    kw = make_case(104, 4, 16, 21, 8, 1, h0=False)
    arrays, static = split(kw)
    x = NamedSharding(mesh, P("data", "model", None))
    placed = {k: jax.device_put(arrays[k], x) for k in ("u", "delta", "z")}
    placed["A"] = jax.device_put(arrays["A"], NamedSharding(mesh, P("model", None)))
    placed.update({k: jax.device_put(arrays[k], NamedSharding(mesh, P("data"))) for k in ("B", "C")})
    placed.update({k: arrays[k] for k in ("D", "delta_bias")})
    f = jax.jit(lambda a: xla_ssm.selective_scan(**a, **static))
    out = f(placed)
    assert out.sharding.is_equivalent_to(x, 3), out.sharding
    assert_close("out", out, xla_ssm.selective_scan_ref(**arrays, **static)[0], (2e-5, 1e-4))
    assert not GATHER.search(f.lower(placed).compile().as_text())
