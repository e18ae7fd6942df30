"""Scans over operands sharded along seqlen (8 CPU devices, see conftest.py): outputs, final states
and gradients equal the unsharded call's, results keep the sharding, and the compiled program moves
only the shards' summaries: no collective has a result as long as the sequence (or its checkpoints)."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
import xla_ssm
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_selective_scan_grad import GRAD_TOL, cotangents, loss_fn, split
from test_selective_scan_jax import BF16, F32, assert_close, make_case

COLLECTIVE = re.compile(r"\b(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(-start)?\(")


@pytest.fixture(autouse=True)
def records_on_the_cpu(monkeypatch):
    """The records' way (docs/sharding.md) wherever the CUDA forward would take it, as on a GPU:
    the scan's chunk records where it would split a shard, SSD's part records where its
    tensor-core kernels run the shape as it is. The CPU's own way is the carry (the product)."""
    monkeypatch.setattr(xla_ssm._scan_seq, "RECORDS_PLATFORMS", ("cpu", "gpu"))
    monkeypatch.setattr(xla_ssm._ssd_seq, "RECORDS_PLATFORMS", ("cpu", "gpu"))


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip(f"needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), have {len(devices)}")
    return Mesh(np.array(devices[:8]).reshape(2, 4), ("a", "l"))


def long_collectives(hlo, seqlen, interval=xla_ssm.CHECKPOINT_LEN):
    """Collectives whose result has an axis of the sequence's length or of its count of checkpoint
    intervals (SSD: chunks)."""
    lengths = {seqlen, -(-seqlen // interval)}
    found = []
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if not m or "=" not in line[: m.start()]:
            continue
        result = line[line.index("=") + 1 : m.start()]  # the result's shape(s)
        if any(lengths & {int(x) for x in dims.split(",") if x} for dims in re.findall(r"\[([\d,]*)\]", result)):
            found.append(line.strip()[:160])
    return found


def place(mesh, arrays, layout, bspec, dspec, lspec):
    """Operands sharded as a user would: batch over `bspec`, dim over `dspec`, seqlen over `lspec`."""
    x = P(bspec, dspec, lspec) if layout == "bdl" else P(bspec, lspec, dspec)
    specs = {"u": x, "delta": x, "z": x, "A": P(dspec, None), "D": P(dspec), "delta_bias": P(dspec),
             "initial_state": P(bspec, dspec, None)}  # fmt: skip
    if arrays["B"].ndim == 4:
        specs["B"] = specs["C"] = P(bspec, None, None, lspec) if layout == "bdl" else P(bspec, lspec, None, None)
    else:
        specs["B"] = specs["C"] = P(dspec, None)
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in arrays.items()}, specs


CASES = [  # (id, batch, dim, seqlen, groups, B/C form, make_case options, batch, dim, seqlen axes)
    ("l4-batch-a", 2, 6, 384, 3, "var", {}, "a", None, "l"),
    ("l4-dim-a", 1, 8, 384, 1, "var", dict(h0=False), None, "a", "l"),
    ("l8-invariant-bare", 1, 4, 512, 1, "inv", dict(d=False, z=False, bias=False), None, None, ("a", "l")),
    ("l2-groups", 4, 8, 192, 2, "var", dict(softplus=False, bias=False), "l", None, "a"),
    # Shards of 256 steps: the CUDA forward would split each into 4 chunks, so the chunk records
    # come first and the forward runs from the true state (the cases above carry it afterwards).
    ("l4-records", 1, 6, 1024, 3, "var", {}, None, None, "l"),
]
PARAMS = pytest.mark.parametrize(
    "batch,dim,seqlen,groups,bc,opts,bax,dax,lax", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)


@pytest.mark.parametrize("layout", ["bdl", "bld"])
@PARAMS
def test_forward(mesh, batch, dim, seqlen, groups, bc, opts, bax, dax, lax, layout):
    kw = make_case(300, batch, dim, seqlen, 5, groups, bc=bc, layout=layout, **opts)
    arrays, static = split(kw)
    placed, specs = place(mesh, arrays, layout, bax, dax, lax)
    f = jax.jit(lambda a: xla_ssm.selective_scan(**a, **static, return_final_state=True))
    out, h = f(placed)
    want_out, want_h = xla_ssm.selective_scan(**arrays, **static, return_final_state=True)
    assert_close("out", out, want_out, (1e-5, 1e-4))
    assert_close("final_state", h, want_h, (1e-5, 1e-4))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, specs["u"]), 3), out.sharding
    hlo = f.lower(placed).compile().as_text()
    assert not long_collectives(hlo, seqlen), long_collectives(hlo, seqlen)
    assert "all-gather" in hlo  # the summaries do cross the devices: the check above saw them
    # The chunk records' way exactly where the CUDA forward would split a shard, else the carry's.
    shard_len = seqlen // np.prod([mesh.shape[a] for a in ((lax,) if isinstance(lax, str) else lax)])
    split_shard = xla_ssm._lib.size("xla_ssm_selective_scan_chunk_records_count", batch, dim, shard_len, 5) > 1
    assert ("xla_ssm_selective_scan_chunk_records" in hlo) == split_shard
    assert ("xla_ssm_selective_scan_carry_fwd" in hlo) != split_shard


@PARAMS
def test_gradients(mesh, batch, dim, seqlen, groups, bc, opts, bax, dax, lax):
    layout = "bld" if batch % 2 else "bdl"
    kw = make_case(301, batch, dim, seqlen, 5, groups, bc=bc, layout=layout, **opts)
    arrays, static = split(kw)
    placed, specs = place(mesh, arrays, layout, bax, dax, lax)
    w, v = cotangents(1, kw, F32)
    g = jax.jit(lambda a, w, v: jax.grad(loss_fn(xla_ssm.selective_scan, static, w, v, True))(a))
    w_placed = jax.device_put(w, NamedSharding(mesh, specs["u"]))
    ours = g(placed, w_placed, v)
    want = jax.grad(loss_fn(xla_ssm.selective_scan, static, w, v, True))(arrays)
    for k in arrays:
        assert_close(f"d{k}", ours[k], want[k], GRAD_TOL[F32])
    assert ours["u"].sharding.is_equivalent_to(NamedSharding(mesh, specs["u"]), 3), ours["u"].sharding
    hlo = g.lower(placed, w_placed, v).compile().as_text()
    assert not long_collectives(hlo, seqlen), long_collectives(hlo, seqlen)


def test_bf16_training_step(mesh):
    """bf16 inputs over 4 seqlen shards and 2 batch shards: the gradients of a jitted loss."""
    kw = make_case(302, 2, 8, 384, 4, 1, dtype=BF16, layout="bld")
    arrays, static = split(kw)
    placed, specs = place(mesh, arrays, "bld", "a", None, "l")
    w, v = cotangents(2, kw, BF16)
    g = jax.jit(lambda a: jax.grad(loss_fn(xla_ssm.selective_scan, static, w, v, True))(a))
    ours, want = g(placed), jax.grad(loss_fn(xla_ssm.selective_scan, static, w, v, True))(arrays)
    for k in arrays:
        assert_close(f"d{k}", ours[k], want[k], GRAD_TOL[BF16])
    assert not long_collectives(g.lower(placed).compile().as_text(), 384)


def test_uneven_shards_are_gathered(mesh):
    """Shards that are not whole checkpoint intervals (100 steps over 4): the sequence is gathered
    (the check sees it), and the results are still right."""
    kw = make_case(303, 2, 4, 100, 3)
    arrays, static = split(kw)
    placed, _ = place(mesh, arrays, "bdl", None, None, "l")
    g = jax.jit(lambda a: jax.grad(lambda a: xla_ssm.selective_scan(**a, **static).sum())(a))
    ours, want = g(placed), jax.grad(lambda a: xla_ssm.selective_scan(**a, **static).sum())(arrays)
    for k in arrays:
        assert_close(f"d{k}", ours[k], want[k], GRAD_TOL[F32])
    assert long_collectives(g.lower(placed).compile().as_text(), 100)


# ---------------------------------------------------------------------------------------- SSD
SSD_CASES = [  # (id, batch, seqlen, heads, groups, chunk, make_case options, dtype, batch, heads, seqlen axes)
    ("l4-batch-a", 2, 384, 4, 2, 32, dict(d=2), F32, "a", None, "l"),
    ("l4-heads-a", 1, 768, 4, 2, 64, dict(h0=False), F32, None, "a", "l"),
    ("l8-bare", 1, 512, 2, 1, 32, dict(d=0, z=False, bias=False, h0=False), F32, None, None, ("a", "l")),
    ("l4-bf16-tensor-core", 2, 768, 2, 1, 64, {}, BF16, "a", None, "l"),
]
SSD_PARAMS = pytest.mark.parametrize(
    "batch,seqlen,heads,groups,chunk,opts,dtype,bax,hax,lax", [c[1:] for c in SSD_CASES], ids=[c[0] for c in SSD_CASES]
)


def place_ssd(mesh, arrays, bspec, hspec, lspec):
    x = P(bspec, lspec, hspec, None)
    specs = {"x": x, "z": x, "dt": P(bspec, lspec, hspec), "A": P(hspec), "dt_bias": P(hspec), "D": P(hspec),
             "B": P(bspec, lspec, None, None), "C": P(bspec, lspec, None, None),
             "initial_states": P(bspec, hspec, None, None)}  # fmt: skip
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in arrays.items()}, specs


@SSD_PARAMS
def test_ssd_forward_and_gradients(mesh, batch, seqlen, heads, groups, chunk, opts, dtype, bax, hax, lax):
    import test_ssd_jax as s

    headdim, dstate = (64, 64) if dtype == BF16 else (4, 8)  # bf16 64 x 64: the tensor-core kernels' shape
    kw = s.make_case(310, batch, seqlen, heads, headdim, dstate, groups, dtype=dtype, **opts)
    arrays = {k: v for k, v in kw.items() if k in s.ARRAYS}
    static = dict(chunk_size=chunk, dt_softplus=True)
    placed, specs = place_ssd(mesh, arrays, bax, hax, lax)
    f = jax.jit(lambda a: xla_ssm.ssd(**a, **static, return_final_states=True))
    y, st = f(placed)
    want_y, want_st = xla_ssm.ssd(**arrays, **static, return_final_states=True)
    s.assert_close("y", y, want_y, s.Y_TOL[dtype])
    s.assert_close("final_states", st, want_st, s.STATE_TOL[dtype])
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, specs["x"]), 4), y.sharding
    hlo = f.lower(placed).compile().as_text()
    assert not long_collectives(hlo, seqlen, chunk)
    assert ("xla_ssm_ssd_part_records" in hlo) == (dtype == BF16)  # the tensor-core shape has records

    w, v = s.cotangents(3, kw, dtype)
    w_placed = jax.device_put(w, NamedSharding(mesh, specs["x"]))
    g = jax.jit(lambda a, w: jax.grad(s.loss_fn(xla_ssm.ssd, static, w, v))(a))
    ours, want = g(placed, w_placed), jax.grad(s.loss_fn(xla_ssm.ssd, static, w, v))(arrays)
    for k in arrays:
        s.assert_close(f"d{k}", ours[k], want[k], s.GRAD_TOL[dtype])
    hlo = g.lower(placed, w_placed).compile().as_text()
    assert not long_collectives(hlo, seqlen, chunk), long_collectives(hlo, seqlen, chunk)


def test_long_sequence_example():
    """examples/long_sequence.py (the README's): runs on 8 CPU devices and matches one device."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "long_sequence.py"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, str(example)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    losses = [float(x) for x in re.findall(r"loss ([-\d.e+]+)", run.stdout)]
    assert len(losses) == 2 and abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1]), run.stdout
    assert "y sharded as P(None, 'seq')" in run.stdout, run.stdout
