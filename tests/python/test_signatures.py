"""Every call the package builds matches the library's table of target signatures
(`xla_ssm_target_signatures`, src/ops/signature.rs): the target exists, the attributes are those it
reads with the right types, and the operands and results are the ones its attributes say. The
calls are traced, not run, for every combination of optional inputs, forward and backward."""

from __future__ import annotations

import ctypes
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_ssm

F32 = jnp.float32


@pytest.fixture(scope="module")
def signatures():
    lib = xla_ssm.load()
    fn = lib.xla_ssm_target_signatures
    fn.restype = ctypes.c_char_p
    return {f"xla_ssm_{s['op']}": s for s in json.loads(fn().decode())}


@pytest.fixture
def calls(monkeypatch):
    """The ffi_calls the package makes: (target, number of results, operands, attributes)."""
    seen = []
    real = jax.ffi.ffi_call

    def recording(target, result_shape_dtypes, *args, **kwargs):
        n_results = len(result_shape_dtypes) if isinstance(result_shape_dtypes, (list, tuple)) else 1
        inner = real(target, result_shape_dtypes, *args, **kwargs)

        def call(*operands, **attrs):
            seen.append((target, n_results, len(operands), attrs))
            return inner(*operands, **attrs)

        return call

    monkeypatch.setattr(jax.ffi, "ffi_call", recording)
    return seen


_TYPES = {
    "bool": lambda v: isinstance(v, (bool, np.bool_)),
    "i64": lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)),
    "f32": lambda v: isinstance(v, (float, np.floating)),
    "str": lambda v: isinstance(v, str),
}


def _present(args, attrs):
    names = []
    for a in args:
        kind, _, attr = a["when"].partition(":")
        # An optional flag the call leaves out is false (src/ops/signature.rs, `When::Flag`).
        flag = kind == "flag" and bool(attrs.get(attr, False))
        if kind == "always" or flag or (kind == "nonzero" and int(attrs.get(attr, 0))):
            names.append(a["name"])
    return names


def check(signatures, calls, expected_targets):
    assert calls, "the package made no ffi_call"
    assert {c[0] for c in calls} == set(expected_targets)
    for target, n_results, n_operands, attrs in calls:
        sig = signatures[target]
        table = {a["name"]: a for a in sig["attrs"]}
        unknown = set(attrs) - set(table)
        assert not unknown, f"{target}: attributes the target does not read: {unknown}"
        for name, a in table.items():
            if name in attrs:
                assert _TYPES[a["type"]](attrs[name]), f"{target}: `{name}` = {attrs[name]!r} is not {a['type']}"
            else:
                assert a["optional"], f"{target}: attribute `{name}` missing"
        operands = _present(sig["operands"], attrs)
        assert n_operands == len(operands), f"{target}: {n_operands} operands, the table says {operands}"
        results = _present(sig["results"], attrs)
        assert n_results in (len(results), len(results) + sig["workspace"]), (
            f"{target}: {n_results} results, the table says {results}" + " [+ workspace]" * sig["workspace"]
        )


def rnd(rng, shape, dtype=F32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


@pytest.mark.parametrize("d, z, bias, h0", list(itertools.product([False, True], repeat=4)))
def test_selective_scan(signatures, calls, d, z, bias, h0):
    rng = np.random.default_rng(0)
    batch, dim, seqlen, n = 2, 8, 40, 4
    u, delta = rnd(rng, (batch, dim, seqlen)), rnd(rng, (batch, dim, seqlen))
    A, B, C = -jnp.exp(rnd(rng, (dim, n))), rnd(rng, (batch, 1, n, seqlen)), rnd(rng, (batch, 1, n, seqlen))
    opt = dict(
        D=rnd(rng, (dim,)) if d else None,
        z=rnd(rng, (batch, dim, seqlen)) if z else None,
        delta_bias=rnd(rng, (dim,)) if bias else None,
        initial_state=rnd(rng, (batch, dim, n)) if h0 else None,
    )

    def loss(u, delta, B):
        out, last = xla_ssm.selective_scan(u, delta, A, B, C, **opt, delta_softplus=True, return_final_state=True)
        return out.sum() + last.sum()

    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(u, delta, B)
    check(signatures, calls, ["xla_ssm_selective_scan_fwd", "xla_ssm_selective_scan_bwd"])


@pytest.mark.parametrize("h0", [False, True])
def test_selective_scan_packed(signatures, calls, h0):
    rng = np.random.default_rng(4)
    dim, seqlen, n = 8, 40, 4
    cu = np.asarray([0, 3, 3, 30, 40], np.int32)
    u, delta = rnd(rng, (1, seqlen, dim)), rnd(rng, (1, seqlen, dim))
    A, B, C = -jnp.exp(rnd(rng, (dim, n))), rnd(rng, (1, seqlen, 1, n)), rnd(rng, (1, seqlen, 1, n))
    h = rnd(rng, (4, dim, n)) if h0 else None

    def loss(u, delta, B):
        out, last = xla_ssm.selective_scan(
            u, delta, A, B, C, initial_state=h, return_final_state=True, layout="bld", cu_seqlens=cu
        )
        return out.sum() + last.sum()

    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(u, delta, B)
    check(signatures, calls, ["xla_ssm_selective_scan_fwd", "xla_ssm_selective_scan_bwd"])


@pytest.mark.parametrize("z, bias, softplus, layout", list(itertools.product([False, True], [False, True], [False, True], ["bdl", "bld"])))
def test_selective_scan_carry(signatures, calls, z, bias, softplus, layout):
    """The seqlen-sharded scan's calls: chunk records, the forward given them, the carry (the
    sharded lowering itself runs only under a mesh)."""
    from xla_ssm import _scan, _scan_seq

    rng = np.random.default_rng(5)
    batch, dim, seqlen, n = 2, 8, 40, 4
    x_shape = (batch, dim, seqlen) if layout == "bdl" else (batch, seqlen, dim)
    u, delta = rnd(rng, x_shape), rnd(rng, x_shape)
    A, C = -jnp.exp(rnd(rng, (dim, n))), rnd(rng, (batch, 1, n, seqlen) if layout == "bdl" else (batch, seqlen, 1, n))
    cfg = _scan._Cfg(softplus, layout, 4, False, z, bias, False, True)
    ops = [u, delta, A, C, C] + ([rnd(rng, x_shape)] if z else []) + ([rnd(rng, (dim,))] if bias else [])
    shard = _scan_seq._Shard(cfg, ops)

    def all_calls(u, h):
        sums = shard.interval_sums(16)
        records = _scan_seq.chunk_records(cfg, u, delta, A, C, shard.bias)
        call = _scan._Call("fwd", cfg._replace(has_initial_state=True), 32)
        given = _scan._ffi_call(call, [*shard.plain, h], records)
        return shard.add_carried(u, h, sums, 16), shard.pull(u, sums, 16), given

    jax.make_jaxpr(all_calls)(u, rnd(rng, (batch, dim, n)))
    targets = ["carry_fwd", "carry_bwd", "chunk_records", "fwd"]
    check(signatures, calls, [f"xla_ssm_selective_scan_{t}" for t in targets])


@pytest.mark.parametrize("d, z, bias, h0", list(itertools.product([False, True], repeat=4)))
def test_ssd(signatures, calls, d, z, bias, h0):
    rng = np.random.default_rng(1)
    batch, seqlen, heads, headdim, n = 1, 80, 2, 4, 8
    x, dt = rnd(rng, (batch, seqlen, heads, headdim)), rnd(rng, (batch, seqlen, heads))
    A, B, C = -jnp.exp(rnd(rng, (heads,))), rnd(rng, (batch, seqlen, 1, n)), rnd(rng, (batch, seqlen, 1, n))
    opt = dict(
        D=rnd(rng, (heads,)) if d else None,
        z=rnd(rng, (batch, seqlen, heads, headdim)) if z else None,
        dt_bias=rnd(rng, (heads,)) if bias else None,
        initial_states=rnd(rng, (batch, heads, headdim, n)) if h0 else None,
    )

    def loss(x, dt, B):
        y, last = xla_ssm.ssd(x, dt, A, B, C, chunk_size=32, **opt, dt_softplus=True, return_final_states=True)
        return y.sum() + last.sum()

    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, dt, B)
    check(signatures, calls, ["xla_ssm_ssd_fwd", "xla_ssm_ssd_bwd"])


@pytest.mark.parametrize("bias", [False, True])
def test_ssd_part_records(signatures, calls, bias):
    """The seqlen-sharded SSD's calls: part records, the forward given them (the sharded lowering
    itself runs only under a mesh)."""
    from xla_ssm import _ssd, _ssd_seq

    rng = np.random.default_rng(6)
    batch, seqlen, heads, headdim, n = 1, 128, 2, 64, 64  # a shape the tensor-core kernels run as it is
    x = rnd(rng, (batch, seqlen, heads, headdim)).astype(jnp.bfloat16)
    dt = rnd(rng, (batch, seqlen, heads)).astype(jnp.bfloat16)
    A, B = -jnp.exp(rnd(rng, (heads,))), rnd(rng, (batch, seqlen, 1, n)).astype(jnp.bfloat16)
    bias_op = rnd(rng, (heads,)) if bias else None
    cfg = _ssd._Cfg(64, True, 0.0, float("inf"), 0, False, bias, True, True)

    def both(x, h):
        end, records = _ssd_seq.part_records(cfg, x, dt, A, B, bias_op)
        ops = [x, dt, A, B, B] + ([bias_op] if bias else []) + [h]
        return end, _ssd._ffi_call(_ssd._Call("fwd", cfg, True), ops, records)

    jax.make_jaxpr(both)(x, rnd(rng, (batch, heads, headdim, n)))
    check(signatures, calls, ["xla_ssm_ssd_part_records", "xla_ssm_ssd_fwd"])


@pytest.mark.parametrize("z, h0", list(itertools.product([False, True], repeat=2)))
def test_ssd_packed(signatures, calls, z, h0):
    rng = np.random.default_rng(4)
    seqlen, heads, headdim, n = 50, 2, 4, 8
    cu = jnp.asarray([0, 10, 10, 41, 50], jnp.int32)
    x, dt = rnd(rng, (1, seqlen, heads, headdim)), rnd(rng, (1, seqlen, heads))
    A, B, C = -jnp.exp(rnd(rng, (heads,))), rnd(rng, (1, seqlen, 1, n)), rnd(rng, (1, seqlen, 1, n))
    opt = dict(
        D=rnd(rng, (heads,)),
        z=rnd(rng, (1, seqlen, heads, headdim)) if z else None,
        initial_states=rnd(rng, (4, heads, headdim, n)) if h0 else None,
    )

    def loss(x, dt, B):
        y, last = xla_ssm.ssd(x, dt, A, B, C, chunk_size=32, **opt, return_final_states=True, cu_seqlens=cu)
        return y.sum() + last.sum()

    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, dt, B)
    check(signatures, calls, ["xla_ssm_ssd_fwd", "xla_ssm_ssd_bwd"])
    assert all(c[3].get("has_cu_seqlens") for c in calls)


@pytest.mark.parametrize("bias, h0", list(itertools.product([False, True], repeat=2)))
def test_causal_conv1d(signatures, calls, bias, h0):
    rng = np.random.default_rng(2)
    batch, dim, seqlen, width = 2, 8, 12, 4
    x, w = rnd(rng, (batch, dim, seqlen)), rnd(rng, (dim, width))
    b = rnd(rng, (dim,)) if bias else None
    h = rnd(rng, (batch, dim, width - 1)) if h0 else None
    jax.make_jaxpr(jax.grad(lambda x, w: xla_ssm.causal_conv1d(x, w, b, h, activation="silu").sum(), (0, 1)))(x, w)
    check(signatures, calls, ["xla_ssm_causal_conv1d_fwd", "xla_ssm_causal_conv1d_bwd"])


@pytest.mark.parametrize("bias, h0", list(itertools.product([False, True], repeat=2)))
def test_causal_conv1d_packed(signatures, calls, bias, h0):
    rng = np.random.default_rng(5)
    dim, seqlen, width = 8, 12, 4
    cu = np.asarray([0, 0, 1, 9, 12], np.int32)
    x, w = rnd(rng, (1, seqlen, dim)), rnd(rng, (dim, width))
    b = rnd(rng, (dim,)) if bias else None
    h = rnd(rng, (4, dim, width - 1)) if h0 else None

    def loss(x, w):
        out, last = xla_ssm.causal_conv1d(
            x, w, b, h, activation="silu", layout="bld", return_final_states=True, cu_seqlens=cu
        )
        return out.sum() + last.sum()

    jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w)
    check(signatures, calls, ["xla_ssm_causal_conv1d_fwd", "xla_ssm_causal_conv1d_bwd"])
    assert all(c[3].get("has_cu_seqlens") for c in calls)


@pytest.mark.parametrize("d, z, bias, pool", list(itertools.product([False, True], repeat=4)))
def test_decode(signatures, calls, d, z, bias, pool):
    rng = np.random.default_rng(3)
    batch, dim, n, width, slots = 3, 8, 4, 4, 5
    ix = jnp.asarray([4, -1, 0], jnp.int32) if pool else None
    rows = slots if pool else batch
    ssm_state, conv_state = rnd(rng, (rows, dim, n)), rnd(rng, (rows, dim, width - 1))
    x, dt = rnd(rng, (batch, dim)), rnd(rng, (batch, dim))
    A, B, C = -jnp.exp(rnd(rng, (dim, n))), rnd(rng, (batch, 1, n)), rnd(rng, (batch, 1, n))
    w = rnd(rng, (dim, width))
    opt = dict(
        D=rnd(rng, (dim,)) if d else None,
        z=rnd(rng, (batch, dim)) if z else None,
        dt_bias=rnd(rng, (dim,)) if bias else None,
        state_batch_indices=ix,
    )
    conv_bias = rnd(rng, (dim,)) if bias else None
    jax.make_jaxpr(xla_ssm.selective_state_update)(ssm_state, x, dt, A, B, C, **opt)
    jax.make_jaxpr(lambda x, s: xla_ssm.causal_conv1d_update(x, s, w, conv_bias, "silu", ix))(x, conv_state)
    jax.make_jaxpr(lambda x, cs, ss: xla_ssm.mamba_decode_step(x, cs, w, ss, dt, A, B, C, conv_bias, **opt))(
        x, conv_state, ssm_state
    )
    check(
        signatures,
        calls,
        ["xla_ssm_selective_state_update", "xla_ssm_causal_conv1d_update", "xla_ssm_mamba_decode_step"],
    )
