"""SSD's part records (`xla_ssm_ssd_part_records`, docs/ssd.md, "Part records"): the end states from
zero against the reference's final states, and the forward given the records (its `part_records`
operand) against the forward without: bf16 and f16, dstate 64 and 128, chunk sizes 64 to 256, one
and several groups, with and without dt_bias, softplus and a clamp.

Runs on the default device. On the CPU the forward ignores given records (it has no split); on a
GPU the shapes split into several parts, so the forward must read them:
`test_forward_reads_the_records` changes them and expects other outputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_ssm
from test_ssd_jax import BF16, F16, F32, STATE_TOL, assert_close, make_case, upcast
from xla_ssm import _ssd, _ssd_seq

# (batch, seqlen, heads, headdim, dstate, groups, chunk): 2 and 4 parts on an H100-sized plan.
SHAPES = [(1, 1024, 4, 64, 128, 1, 256), (2, 704, 6, 64, 64, 3, 64)]


def _cfg(chunk, softplus=True, limit=(0.0, float("inf")), has_bias=True, has_h0=False, d_rank=1, has_z=True):
    return _ssd._Cfg(chunk, softplus, limit[0], limit[1], d_rank, has_z, has_bias, has_h0, True)


def _records(kw, cfg):
    ops = [jnp.asarray(kw[k]) for k in ("x", "dt", "A", "B")]
    return _ssd_seq.part_records(cfg, *ops, jnp.asarray(kw["dt_bias"]) if "dt_bias" in kw else None)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["n128-chunk256", "n64-groups-chunk64"])
@pytest.mark.parametrize("variant", ["softplus-bias", "clamp", "bare"])
def test_end_states(shape, dtype, variant):
    batch, seqlen, heads, headdim, dstate, groups, chunk = shape
    bias = variant != "bare"
    kw = make_case(20, batch, seqlen, heads, headdim, dstate, groups, dtype=dtype, z=False, bias=bias, h0=False, d=0)
    softplus, limit = variant != "bare", (0.03, 0.4) if variant == "clamp" else (0.0, float("inf"))
    if not softplus:  # the dt softplus would have made: positive
        kw["dt"] = np.logaddexp(0.0, kw["dt"].astype(np.float32)).astype(dtype)
    cfg = _cfg(chunk, softplus, limit, bias, d_rank=0, has_z=False)
    end, records = _records(kw, cfg)
    assert records.shape[0] == _ssd_seq.part_records_floats(cfg, kw["x"], kw["B"]) > 0
    _, want = xla_ssm.ssd_ref(
        **upcast(kw), chunk_size=chunk, dt_softplus=softplus, dt_limit=limit, return_final_states=True
    )
    assert_close("end states", end, want, STATE_TOL[dtype])


def _forward(kw, cfg, records):
    """The forward from kw's initial states with chunk states, given `records` (None: none)."""
    call = _ssd._Call("fwd", cfg, True)
    names = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states"]
    ops = [jnp.asarray(kw[k]) for k in names if k in kw]
    return jax.jit(lambda ops, r: _ssd._ffi_call(call, ops, r))(ops, records)


@pytest.mark.parametrize("shape", SHAPES, ids=["n128-chunk256", "n64-groups-chunk64"])
def test_forward_given_records(shape):
    """Given its own first pass, the forward returns what it returns without: exactly."""
    batch, seqlen, heads, headdim, dstate, groups, chunk = shape
    kw = make_case(21, batch, seqlen, heads, headdim, dstate, groups, dtype=BF16)
    cfg = _cfg(chunk, has_h0=True)
    _, records = _records(kw, cfg)
    given, made = _forward(kw, cfg, records), _forward(kw, cfg, None)
    for name, a, b in zip(("y", "final_states", "chunk_states"), given, made):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


def test_forward_reads_the_records():
    """On a GPU the split's second pass starts each part from the records before it: other
    records, other outputs after the first part (the CPU has no split and ignores them)."""
    if jax.default_backend() == "cpu":
        pytest.skip("the CPU forward has no split: given records are not read")
    kw = make_case(22, *SHAPES[0][:6], dtype=BF16)
    cfg = _cfg(SHAPES[0][6], has_h0=True)
    _, records = _records(kw, cfg)
    batch, _, heads, headdim, dstate = kw["x"].shape[:4] + (kw["B"].shape[3],)
    state = batch * heads * headdim * dstate
    n_parts = records.shape[0] // (state + batch * heads)
    assert n_parts > 1
    # The last record the forward reads: the state entering the last part (an earlier one may have
    # decayed to nothing by the end).
    changed = records.at[(n_parts - 2) * state].add(1.0)
    y, final, _ = _forward(kw, cfg, records)
    y2, final2, _ = _forward(kw, cfg, changed)
    assert not np.array_equal(np.asarray(y, np.float32), np.asarray(y2, np.float32))
    assert not np.array_equal(np.asarray(final), np.asarray(final2))


def test_refused():
    """Shapes the tensor-core kernels do not run as they are have no records; a wrong records
    operand is refused."""
    for dtype, headdim, dstate, chunk in [(F32, 64, 64, 64), (BF16, 128, 64, 64), (BF16, 64, 16, 64), (BF16, 64, 64, 32)]:
        kw = make_case(23, 1, 64, 2, headdim, dstate, dtype=dtype, z=False, h0=False, d=0)
        cfg = _cfg(chunk, d_rank=0, has_z=False)
        assert _ssd_seq.part_records_floats(cfg, kw["x"], kw["B"]) == 0
        with pytest.raises(Exception, match="tensor-core kernels"):
            jax.block_until_ready(_records(kw, cfg))
    kw = make_case(24, *SHAPES[1][:6], dtype=BF16)
    cfg = _cfg(SHAPES[1][6], has_h0=True)
    _, records = _records(kw, cfg)
    with pytest.raises(Exception, match="part_records"):
        jax.block_until_ready(_forward(kw, cfg, records[:-1]))
    with pytest.raises(ValueError):
        xla_ssm._lib.size("xla_ssm_ssd_part_records_floats", 1, 64, 3, 64, 64, 2, 64, 1)  # 3 heads, 2 groups
