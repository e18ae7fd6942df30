"""The chunk records (`xla_ssm_selective_scan_chunk_records`, docs/selective_scan_fwd.md, "Chunk
records") against a reference that scans each chunk from a zero state, and the forward given them
(its `chunk_records` operand) against the forward without: both layouts, every dtype pair,
time-varying and time-invariant B, groups, with and without delta_bias and softplus.

Runs on the default device. On the CPU the forward ignores given records (it has no split); on a
GPU the shapes take both CUDA records kernels (the tiled first pass: whole 16-byte rows and one
group a tile; the fallback: 700 steps, groups of 4 channels), and the forward must read them:
`test_forward_reads_the_records` changes them and expects other outputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_selective_scan_jax import BF16, F16, F32, assert_close, make_case
from xla_ssm import _lib, _scan, _scan_seq

# (batch, dim, seqlen, dstate, groups): on a GPU the first takes the tiled pass, the second the
# fallback (seqlen not whole 16-byte rows; 4 channels a group); both split (more than one chunk).
SHAPES = [(1, 128, 1024, 16, 2), (2, 8, 700, 20, 2)]
TYPES = [(F32, F32), (BF16, BF16), (BF16, F32), (F16, F16), (F16, F32)]
# Every dtype's inputs are rounded before the reference sees them: what is left is f32 arithmetic.
TOL = (2e-5, 1e-4)


def _cfg(kw, has_h0=False):
    return _scan._Cfg(
        delta_softplus=kw["delta_softplus"],
        layout=kw["layout"],
        bc_rank=kw["B"].ndim,
        has_d="D" in kw,
        has_z="z" in kw,
        has_delta_bias="delta_bias" in kw,
        has_initial_state=has_h0,
        return_final_state=True,
    )


def _records(kw):
    return _scan_seq.chunk_records(
        _cfg(kw), *(jnp.asarray(kw[k]) for k in ("u", "delta", "A", "B")), kw.get("delta_bias")
    )


def _reference(kw, n_chunks):
    """(end states from zero (n_chunks, batch, dim, dstate), sums of dt (n_chunks, batch, dim)) by
    the recurrence, step by step in f64 on the inputs' rounded values."""
    f64 = {k: (np.asarray(v, np.float64) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    bdl = kw["layout"] == "bdl"
    u, delta = ((f64[k] if bdl else f64[k].transpose(0, 2, 1)) for k in ("u", "delta"))  # (b, d, l)
    batch, dim, seqlen = u.shape
    A, B = f64["A"], f64["B"]
    if B.ndim == 4:  # (b, g, n, l), then a row per channel
        B = B if bdl else B.transpose(0, 2, 3, 1)
        B = np.repeat(B, dim // B.shape[1], axis=1)
    else:  # (d, n): the same at every step
        B = np.broadcast_to(B[None, :, :, None], (batch, dim, A.shape[1], seqlen))
    dt = delta + (f64["delta_bias"][None, :, None] if "delta_bias" in kw else 0.0)
    dt = np.logaddexp(0.0, dt) if kw["delta_softplus"] else dt
    chunk_len = -(-(-(-seqlen // n_chunks)) // 32) * 32
    ends, sums = [], []
    for k in range(n_chunks):
        h = np.zeros((batch, dim, A.shape[1]))
        steps = range(k * chunk_len, min(seqlen, (k + 1) * chunk_len))
        for l in steps:
            h = np.exp(A * dt[:, :, l, None]) * h + (dt[:, :, l] * u[:, :, l])[..., None] * B[..., l]
        ends.append(h)
        sums.append(dt[:, :, steps.start : steps.stop].sum(axis=2))
    return np.stack(ends), np.stack(sums)


@pytest.mark.parametrize("layout", ["bdl", "bld"])
@pytest.mark.parametrize("dtype,bc_dtype", TYPES, ids=lambda t: jnp.dtype(t).name)
@pytest.mark.parametrize("shape", SHAPES, ids=["tiled", "fallback"])
def test_matches_reference(shape, dtype, bc_dtype, layout):
    batch, dim, seqlen, dstate, groups = shape
    kw = make_case(7, batch, dim, seqlen, dstate, groups, dtype=dtype, bc_dtype=bc_dtype, layout=layout)
    records = np.asarray(_records(kw))
    n_chunks, floats = records.shape[0], records.shape[-1]
    assert n_chunks > 1 and records.shape[1:3] == (batch, dim), records.shape
    assert floats == _lib.size("xla_ssm_selective_scan_chunk_record_floats", dstate) > dstate
    ends, sums = _reference(kw, n_chunks)
    assert_close("end states", records[..., :dstate], ends, TOL)
    assert_close("sums of dt", records[..., -1], sums, (2e-6, 2e-5))
    assert not records[..., dstate:-1].any(), "the padding states are not 0"


@pytest.mark.parametrize(
    "bc,opts",
    [("inv", {}), ("var", dict(softplus=False, bias=False))],
    ids=["invariant", "no-softplus-no-bias"],
)
@pytest.mark.parametrize("shape", SHAPES, ids=["tiled", "fallback"])
def test_options(shape, bc, opts):
    batch, dim, seqlen, dstate, groups = shape
    kw = make_case(8, batch, dim, seqlen, dstate, groups, bc=bc, dtype=BF16, **opts)
    records = np.asarray(_records(kw))
    ends, sums = _reference(kw, records.shape[0])
    assert_close("end states", records[..., :dstate], ends, TOL)
    assert_close("sums of dt", records[..., -1], sums, (2e-6, 2e-5))


def _forward(kw, records, checkpoint_len=32):
    """The forward from kw's initial state, given `records` (None: none): (out, final, checkpoints)."""
    call = _scan._Call("fwd", _cfg(kw, has_h0=True), checkpoint_len)
    names = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state"]
    ops = [jnp.asarray(kw[k]) for k in names if k in kw]
    return jax.jit(lambda ops, r: _scan._ffi_call(call, ops, r))(ops, records)


@pytest.mark.parametrize("layout", ["bdl", "bld"])
@pytest.mark.parametrize("shape", SHAPES, ids=["tiled", "fallback"])
def test_forward_given_records(shape, layout):
    """Given its own first pass, the forward returns what it returns without: exactly."""
    batch, dim, seqlen, dstate, groups = shape
    kw = make_case(9, batch, dim, seqlen, dstate, groups, dtype=BF16, layout=layout)
    given = _forward(kw, _records(kw))
    made = _forward(kw, None)
    for name, a, b in zip(("out", "final_state", "checkpoints"), given, made):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


def test_forward_reads_the_records():
    """On a GPU the split's second pass starts each chunk from the records before it: other
    records, other outputs after the first chunk (the CPU has no split and ignores them)."""
    if jax.default_backend() == "cpu":
        pytest.skip("the CPU forward has no split: given records are not read")
    kw = make_case(10, *SHAPES[0], dtype=BF16)
    records = _records(kw)
    out, final, _ = _forward(kw, records)
    out2, final2, _ = _forward(kw, records.at[..., 0].add(1.0))
    n_chunks, seqlen = records.shape[0], kw["u"].shape[2]
    first = -(-(-(-seqlen // n_chunks)) // 32) * 32
    same = np.asarray(out[..., :first], np.float32) == np.asarray(out2[..., :first], np.float32)
    assert same.all(), "the first chunk needs no record"
    assert not np.array_equal(np.asarray(out[..., first:]), np.asarray(out2[..., first:]))
    assert not np.array_equal(np.asarray(final), np.asarray(final2))


def test_refused():
    kw = make_case(11, *SHAPES[1], dtype=F32)
    records = _records(kw)
    with pytest.raises(Exception, match="chunk_records"):
        jax.block_until_ready(_forward(kw, records[:1]))
    with pytest.raises(ValueError, match="dstate must be at most 256"):
        _lib.size("xla_ssm_selective_scan_chunk_record_floats", 257)
    with pytest.raises(ValueError):
        _lib.size("xla_ssm_selective_scan_chunk_records_count", -1, 8, 8, 16)
