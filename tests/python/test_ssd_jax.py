"""`xla_ssm.ssd` (Mamba-2's chunked SSD scan) through JAX: the forward against the lax.scan
reference `xla_ssm.ssd_ref`, gradients against jax.grad of it, vmap (folded into one call), jit,
and the checks in Python.

Run: PYTHONPATH=bindings/python XLA_SSM_LIBRARY=target/release/libxla_ssm.so pytest tests/python
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_ssm

F32, BF16, F16 = np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
ARRAYS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
EXAMPLE = ("x", "dt", "B", "C", "z", "initial_states")  # have a batch axis
PARAMS = ("A", "D", "dt_bias")  # per head
# (relative L2 error, max |err| / max |ref|): the kernel accumulates in f32 like the reference; a
# half type adds its rounding (and, with an active clamp, that of the transformed dt).
Y_TOL = {F32: (2e-5, 1e-4), BF16: (1e-2, 2e-2), F16: (2e-3, 4e-3)}
STATE_TOL = {F32: (2e-5, 1e-4), BF16: (1e-2, 2e-2), F16: (2e-3, 4e-3)}
GRAD_TOL = {F32: (1e-4, 1e-3), BF16: (3e-2, 6e-2)}
CLAMP = (0.03, 0.4)




def make_case(seed, batch, seqlen, heads, headdim, dstate, groups=1, *, dtype=F32, d=1, z=True, bias=True, h0=True):
    """Arrays for ssd / ssd_ref (d: 0 no D, 1 per head, 2 per channel); dt is drawn so that
    softplus(dt + dt_bias) spreads over 0.01..1."""
    rng = np.random.default_rng(seed)

    def randn(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    kw = dict(
        x=randn(batch, seqlen, heads, headdim).astype(dtype),
        A=-np.exp(0.5 * randn(heads)),
        B=randn(batch, seqlen, groups, dstate).astype(dtype),
        C=randn(batch, seqlen, groups, dstate).astype(dtype),
    )
    eff = np.exp(rng.uniform(np.log(0.01), 0.0, (batch, seqlen, heads)))
    pre = np.log(np.expm1(eff))
    if bias:
        kw["dt_bias"] = rng.uniform(-0.5, 0.5, heads).astype(np.float32)
        pre = pre - kw["dt_bias"]
    kw["dt"] = pre.astype(np.float32).astype(dtype)
    if d:
        kw["D"] = randn(heads) if d == 1 else randn(heads, headdim)
    if z:
        kw["z"] = randn(batch, seqlen, heads, headdim).astype(dtype)
    if h0:
        kw["initial_states"] = randn(batch, heads, headdim, dstate)
    return kw


def upcast(kw):
    return {k: v.astype(np.float32) if isinstance(v, np.ndarray) else v for k, v in kw.items()}


def assert_close(name, got, want, tol):
    rel_l2, rel_max = tol
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
    if want.size == 0:
        return
    assert np.isfinite(got).all(), f"{name}: non-finite values"
    diff = got - want
    rel = np.linalg.norm(diff) / max(np.linalg.norm(want), 1e-30)
    mx, scale = np.abs(diff).max(), max(np.abs(want).max(), 1e-30)
    assert rel <= rel_l2, f"{name}: relative L2 error {rel:.3g} > {rel_l2:.3g}"
    assert mx <= rel_max * scale, f"{name}: max |err| {mx:.3g} > {rel_max:.3g} * max|ref| ({scale:.3g})"


STATIC = ("chunk_size", "dt_softplus", "dt_limit", "return_final_states")
ours = jax.jit(xla_ssm.ssd, static_argnames=STATIC)
ref = jax.jit(xla_ssm.ssd_ref, static_argnames=STATIC)


def check_forward(kw, **static):
    y, s = ours(**kw, **static, return_final_states=True)
    y_ref, s_ref = ref(**upcast(kw), **static, return_final_states=True)
    x = kw["x"]
    assert y.dtype == x.dtype and y.shape == x.shape
    assert s.dtype == jnp.float32 and s.shape == (x.shape[0], x.shape[2], x.shape[3], kw["B"].shape[3])
    dtype = np.dtype(x.dtype)
    assert_close("y", y, y_ref, Y_TOL[dtype])
    assert_close("final_states", s, s_ref, STATE_TOL[dtype])


# ------------------------------------------------------------------------------------ forward
FORWARD = [  # (batch, seqlen, heads, headdim, dstate, groups, chunk_size, dtype, D form, dt_limit)
    pytest.param(2, 37, 4, 3, 5, 2, 32, F32, 1, (0.0, np.inf), id="odd-seqlen-g2"),
    pytest.param(1, 130, 4, 8, 16, 4, 64, F32, 2, CLAMP, id="groups=heads-clamp"),
    pytest.param(2, 70, 2, 64, 8, 1, 256, F32, 0, (-np.inf, np.inf), id="seqlen<chunk"),
    pytest.param(1, 1, 2, 4, 256, 1, 32, F32, 1, (0.0, np.inf), id="dstate256-seqlen1"),
    pytest.param(2, 45, 4, 16, 16, 2, 32, BF16, 1, (0.0, np.inf), id="bf16"),
    pytest.param(2, 45, 4, 16, 16, 2, 32, BF16, 2, CLAMP, id="bf16-clamp"),
    pytest.param(2, 45, 4, 16, 16, 1, 128, F16, 1, CLAMP, id="f16-clamp"),
]


@pytest.mark.parametrize("batch,seqlen,heads,headdim,dstate,groups,chunk,dtype,d,limit", FORWARD)
def test_forward(batch, seqlen, heads, headdim, dstate, groups, chunk, dtype, d, limit):
    kw = make_case(1, batch, seqlen, heads, headdim, dstate, groups, dtype=dtype, d=d)
    check_forward(kw, chunk_size=chunk, dt_softplus=True, dt_limit=limit)


@pytest.mark.compat
def test_forward_options_and_chunk_sizes():
    """No optional operand, no softplus; every chunk size gives the same y (the math does not
    depend on it)."""
    kw = make_case(2, 2, 100, 4, 4, 8, 2, d=0, z=False, bias=False, h0=False)
    kw["dt"] = np.abs(kw["dt"]) * 0.1
    check_forward(kw, dt_softplus=False, dt_limit=(-np.inf, np.inf))
    ys = [np.asarray(ours(**kw, chunk_size=c)) for c in xla_ssm.CHUNK_SIZES]
    for y in ys[1:]:
        np.testing.assert_allclose(y, ys[0], rtol=1e-6, atol=1e-6)
    # Only y unless asked for the states.
    assert isinstance(ours(**kw), jax.Array)


def test_zero_sized():
    for shape in [(2, 0, 2, 3, 4), (0, 5, 2, 3, 4)]:
        kw = make_case(3, *shape)
        y, s = xla_ssm.ssd(**kw, chunk_size=32, dt_softplus=True, return_final_states=True)
        assert y.shape == kw["x"].shape
        if shape[1] == 0:
            np.testing.assert_array_equal(s, kw["initial_states"])


# ------------------------------------------------------------------------------ gradients
def loss_fn(scan, static, w, v):
    def loss(arrays):
        y, s = scan(**arrays, **static, return_final_states=True)
        return jnp.sum(y.astype(jnp.float32) * w) + jnp.sum(s * v)

    return loss


def cotangents(seed, kw, dtype):
    rng = np.random.default_rng(seed)
    x, B = kw["x"], kw["B"]
    w = rng.standard_normal(x.shape).astype(dtype).astype(np.float32)
    v = rng.standard_normal((x.shape[0], x.shape[2], x.shape[3], B.shape[3])).astype(np.float32)
    return w, v


def check_grads(kw, static, seed=0):
    dtype = np.dtype(kw["x"].dtype)
    w, v = cotangents(seed, kw, dtype)
    got = jax.jit(jax.grad(loss_fn(xla_ssm.ssd, static, w, v)))(kw)
    want = jax.jit(jax.grad(loss_fn(xla_ssm.ssd_ref, static, w, v)))(upcast(kw))
    for k in kw:
        assert got[k].dtype == kw[k].dtype and got[k].shape == kw[k].shape, k
        assert_close(f"d{k}", got[k], want[k], GRAD_TOL[dtype])


GRADS = [  # (groups, D form, softplus, dt_limit, dtype)
    pytest.param(2, 1, True, (0.0, np.inf), F32, id="f32"),
    pytest.param(4, 2, True, CLAMP, F32, id="f32-clamp-Dchannel"),
    pytest.param(1, 1, False, (-np.inf, np.inf), F32, id="f32-nosoftplus"),
    pytest.param(2, 2, True, CLAMP, BF16, id="bf16-clamp"),
]


@pytest.mark.compat
@pytest.mark.parametrize("groups,d,softplus,limit,dtype", GRADS)
def test_grad(groups, d, softplus, limit, dtype):
    kw = make_case(4, 2, 70, 4, 8, 8, groups, dtype=dtype, d=d)
    if not softplus:
        kw["dt"] = (np.abs(kw["dt"].astype(np.float32)) * 0.1).astype(dtype)
    check_grads(kw, dict(chunk_size=32, dt_softplus=softplus, dt_limit=limit))


def test_chunk_states_in_dtype_at_tensor_core_shapes():
    """Where the CUDA tensor-core kernels run (bf16/f16, headdim at least 32, dstate up to 256,
    chunk_size 64..256) the forward saves chunk_states in x's dtype on every platform (half the
    memory of f32), elsewhere in f32; the gradients hold either way."""
    static = dict(chunk_size=64, dt_softplus=True)
    cases = [(BF16, 64, 64, BF16), (F16, 64, 64, F16), (BF16, 128, 64, BF16), (BF16, 64, 16, BF16)]
    cases += [(BF16, 64, 256, BF16), (F16, 64, 200, F16), (BF16, 32, 64, BF16), (BF16, 16, 64, F32)]
    cases += [(F32, 64, 64, F32)]
    for dtype, headdim, dstate, want in cases:
        kw = make_case(6, 1, 150, 2, headdim, dstate, dtype=dtype)
        _, vjp_fn = jax.vjp(lambda a: xla_ssm.ssd(**a, **static), kw)
        residuals = [r for r in jax.tree_util.tree_leaves(vjp_fn) if getattr(r, "ndim", 0) == 5]
        assert [(r.shape, r.dtype) for r in residuals] == [((1, 2, headdim, 3, dstate), want)], (dtype, headdim)
    kw = make_case(6, 1, 150, 2, 64, 64, dtype=BF16)
    check_grads(kw, static)


@pytest.mark.parametrize("returned", ["y", "y-and-unused-final", "final"])
def test_grad_of_one_result(returned):
    """A loss of y alone, with or without final_states returned, runs the backward without
    dfinal_states (an unused one's cotangent is a symbolic zero, which is not passed); a loss of
    final_states alone drives every gradient through dfinal_states (dy is zeros)."""
    kw = make_case(5, 1, 40, 2, 4, 4)
    w, v = cotangents(0, kw, F32)
    static = dict(chunk_size=32, dt_softplus=True, return_final_states=returned != "y")

    def loss(scan):
        def f(a):
            out = scan(**a, **static)
            if returned == "final":
                return jnp.sum(out[1] * v)
            return jnp.sum((out if returned == "y" else out[0]) * w)

        return f

    grad = jax.jit(jax.grad(loss(xla_ssm.ssd)))
    passed = re.findall(r"has_dfinal_states = (\w+)", grad.lower(kw).as_text())
    assert passed == [str(returned == "final").lower()]
    got = grad(kw)
    want = jax.grad(loss(xla_ssm.ssd_ref))(kw)
    for k in kw:
        assert_close(f"d{k}", got[k], want[k], GRAD_TOL[F32])


# ----------------------------------------------------------------------------------- vmap
def stack(kws, keys):
    return {k: np.stack([kw[k] for kw in kws]) for k in keys}


def per_example(seed0, n):
    return [make_case(seed0 + i, 2, 41, 4, 3, 5, 2) for i in range(n)]


@pytest.mark.compat
@pytest.mark.parametrize("mapped_params", [False, True], ids=["shared-params", "mapped-params"])
def test_vmap_forward_one_call(mapped_params):
    """vmap folds into a single FFI call (into batch, or into heads when parameters are mapped)."""
    kws = per_example(30, 3)
    mapped = EXAMPLE + (PARAMS if mapped_params else ())
    xs = stack(kws, mapped)
    shared = {k: kws[0][k] for k in ARRAYS if k not in mapped}
    static = dict(chunk_size=32, dt_softplus=True, return_final_states=True)

    def f(a):
        return xla_ssm.ssd(**a, **shared, **static)

    y, s = jax.jit(jax.vmap(f))(xs)
    for i in range(3):
        yr, sr = xla_ssm.ssd_ref(**{k: kws[i][k] for k in mapped}, **shared, **static)
        assert_close("y", y[i], yr, Y_TOL[F32])
        assert_close("final_states", s[i], sr, STATE_TOL[F32])
    hlo = jax.jit(jax.vmap(f)).lower(xs).as_text()
    # One call for the 3 examples (older jax, e.g. 0.5, also lowers the other platform's branch: 2).
    assert hlo.count("xla_ssm_ssd_fwd") in (1, 2) and "while" not in hlo, hlo


def test_vmap_nested_and_in_axes():
    kws = [per_example(40 + 3 * j, 3) for j in range(2)]
    xs = {k: np.stack([stack(row, EXAMPLE)[k] for row in kws]) for k in EXAMPLE}  # (2, 3, ...)
    shared = {k: kws[0][0][k] for k in PARAMS}

    def f(a):
        return xla_ssm.ssd(**a, **shared, chunk_size=32, dt_softplus=True)

    y = jax.jit(jax.vmap(jax.vmap(f)))(xs)
    y_t = jax.vmap(jax.vmap(f), in_axes=1, out_axes=1)({k: np.swapaxes(v, 0, 1) for k, v in xs.items()})
    np.testing.assert_allclose(np.asarray(y_t), np.asarray(y).swapaxes(0, 1), rtol=1e-6, atol=1e-6)
    want = jax.vmap(jax.vmap(lambda a: xla_ssm.ssd_ref(**a, **shared, dt_softplus=True)))(xs)
    assert_close("y", y, want, Y_TOL[F32])


@pytest.mark.parametrize("mapped_params", [False, True], ids=["shared-params", "mapped-params"])
def test_vmap_of_grad(mapped_params):
    """Per-example gradients, shared parameters included (each example gets its own dA, dD, ...)."""
    kws = per_example(50, 3)
    mapped = EXAMPLE + (PARAMS if mapped_params else ())
    xs = stack(kws, mapped)
    shared = {k: kws[0][k] for k in ARRAYS if k not in mapped}
    w, v = cotangents(0, kws[0], F32)
    static = dict(chunk_size=32, dt_softplus=True, dt_limit=CLAMP)

    def grads(scan):
        def loss(a, s):
            return loss_fn(scan, static, w, v)({**a, **s})

        return jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))

    got, want = grads(xla_ssm.ssd)(xs, shared), grads(xla_ssm.ssd_ref)(xs, shared)
    for part in (0, 1):
        for k in got[part]:
            assert got[part][k].shape[0] == 3
            assert_close(f"d{k}", got[part][k], want[part][k], GRAD_TOL[F32])


# ----------------------------------------------------------------------------------- errors
def base():
    return make_case(6, 2, 10, 4, 3, 5, 2)


ERRORS = [
    ("x", lambda kw: kw["x"][0], ValueError, r"x must have rank 4"),
    ("x", lambda kw: kw["x"].astype(np.float64), TypeError, r"x must be float32, bfloat16 or float16"),
    ("dt", lambda kw: kw["dt"][..., :3], ValueError, r"dt must have shape \(batch, seqlen, heads\)=\(2, 10, 4\)"),
    ("dt", lambda kw: kw["dt"].astype(BF16), TypeError, r"dt must be the dtype of x \(float32\)"),
    ("A", lambda kw: kw["A"][:, None], ValueError, r"A must have shape \(heads,\)=\(4,\)"),
    ("A", lambda kw: kw["A"].astype(BF16), TypeError, r"A must be float32"),
    ("B", lambda kw: kw["B"][:, :, :1].repeat(3, axis=2), ValueError, r"multiple of groups \(3\)"),
    ("C", lambda kw: kw["C"][..., :4], ValueError, r"C must have shape"),
    ("D", lambda kw: np.zeros((4, 2), np.float32), ValueError, r"D must have shape \(heads, headdim\)=\(4, 3\)"),
    ("z", lambda kw: kw["z"][:, :9], ValueError, r"z must have shape"),
    ("dt_bias", lambda kw: kw["dt_bias"][:2], ValueError, r"dt_bias must have shape \(heads,\)"),
    ("initial_states", lambda kw: kw["initial_states"][..., :4], ValueError, r"initial_states must have shape"),
]


@pytest.mark.parametrize("name,mutate,exc,match", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors(name, mutate, exc, match):
    kw = base()
    kw[name] = mutate(kw)
    with pytest.raises(exc, match=match):
        xla_ssm.ssd(**kw, chunk_size=32)


def test_static_argument_errors():
    kw = base()
    with pytest.raises(ValueError, match=r"chunk_size must be one of \(32, 64, 128, 256\), got 100"):
        xla_ssm.ssd(**kw, chunk_size=100)
    with pytest.raises(ValueError, match=r"dt_limit must have dt_min <= dt_max"):
        xla_ssm.ssd(**kw, dt_limit=(0.5, 0.1))
    with pytest.raises(TypeError, match=r"dt_limit must be a pair"):
        xla_ssm.ssd(**kw, dt_limit=0.5)
    with pytest.raises(TypeError, match=r"dt_softplus must be a Python bool"):
        xla_ssm.ssd(**kw, dt_softplus=jnp.bool_(True))


# ------------------------------------------------------------------------- packed sequences
def make_packed(seed, lens, heads=4, headdim=3, dstate=5, groups=2, **kw):
    """A batch-1 case of sequences of these lengths packed along seqlen, with an initial state per
    sequence; (arrays, cu_seqlens)."""
    case = make_case(seed, 1, sum(lens), heads, headdim, dstate, groups, **kw)
    if "initial_states" in case:
        rng = np.random.default_rng(seed + 1000)
        case["initial_states"] = rng.standard_normal((len(lens), heads, headdim, dstate)).astype(np.float32)
    return case, np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def sequence(kw, cu, s):
    """Sequence s of a packed case as an unpacked one (batch 1)."""
    lo, hi = int(cu[s]), int(cu[s + 1])
    one = {k: v[:, lo:hi] if k in ("x", "dt", "B", "C", "z") else v for k, v in kw.items()}
    if "initial_states" in kw:
        one["initial_states"] = kw["initial_states"][s : s + 1]
    return one


PACKED_LENS = [0, 7, 1, 40, 0, 33, 64, 2, 0]  # empty and length-1 ones, boundaries off the chunk grid


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_packed_forward(dtype):
    """Packed == one call per sequence == ssd_ref, under jit with the boundaries traced."""
    kw, cu = make_packed(60, PACKED_LENS, dtype=dtype)
    static = dict(chunk_size=32, dt_softplus=True, dt_limit=CLAMP)
    y, s = ours(**kw, **static, return_final_states=True, cu_seqlens=cu)
    assert y.shape == kw["x"].shape and s.shape == (len(PACKED_LENS), 4, 3, 5) and s.dtype == jnp.float32
    for i in range(len(PACKED_LENS)):
        yi, si = ours(**sequence(kw, cu, i), **static, return_final_states=True)
        lo, hi = cu[i], cu[i + 1]
        assert_close(f"y of sequence {i}", y[:, lo:hi], yi, (1e-6, 1e-5) if dtype == F32 else Y_TOL[dtype])
        assert_close(f"final state {i}", s[i], si[0], (1e-6, 1e-5))
    y_ref, s_ref = jax.jit(lambda a: xla_ssm.ssd_ref(**a, **static, return_final_states=True, cu_seqlens=cu))(upcast(kw))
    assert_close("y", y, y_ref, Y_TOL[dtype])
    assert_close("final_states", s, s_ref, STATE_TOL[dtype])


@pytest.mark.parametrize("lens, headdim, dstate, chunk", [
    ([0, 70, 1, 129, 0], 64, 64, 64),
    ([3, 0, 3, 3, 64, 3, 40, 3], 128, 128, 64),  # several boundaries in a tile (few lengths: few compiles)
    ([0, 70, 1, 129, 0], 64, 256, 128),  # a state of two halves
    ([0, 70, 1, 129, 0], 32, 64, 64),  # heads widened to 64
])
def test_packed_tensor_core_shape(lens, headdim, dstate, chunk):
    """bf16 at the CUDA tensor-core shapes: chunk_states in bf16; there the forward of a packed call
    runs on the tensor-core kernels (its tiles cut at the boundaries), its backward with states on the
    generic path, without on the tensor-core kernels; gradients both ways."""
    kw, cu = make_packed(61, lens, heads=2, headdim=headdim, dstate=dstate, groups=1, dtype=BF16)
    static = dict(chunk_size=chunk, dt_softplus=True)
    y, s = ours(**kw, **static, return_final_states=True, cu_seqlens=cu)
    y_ref, s_ref = jax.jit(lambda a: xla_ssm.ssd_ref(**a, **static, return_final_states=True, cu_seqlens=cu))(upcast(kw))
    assert_close("y", y, y_ref, Y_TOL[BF16])
    assert_close("final_states", s, s_ref, STATE_TOL[BF16])
    check_packed_grads(kw, cu, static)
    # Without states (a training step's gradients): on CUDA the tensor-core backward, its decays cut
    # at the boundaries.
    check_packed_grads({k: v for k, v in kw.items() if k != "initial_states"}, cu, static, states=False)


def check_packed_grads(kw, cu, static, seed=0, states=True):
    """Gradients of sum(y w) (+ sum(final_states v) with `states`) against the reference's."""
    dtype = np.dtype(kw["x"].dtype)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(kw["x"].shape).astype(dtype).astype(np.float32)
    heads, headdim, dstate = kw["x"].shape[2], kw["x"].shape[3], kw["B"].shape[3]
    v = rng.standard_normal((len(cu) - 1, heads, headdim, dstate)).astype(np.float32)

    def loss(scan):
        def f(a):
            if not states:
                return jnp.sum(scan(**a, **static, cu_seqlens=cu).astype(jnp.float32) * w)
            y, s = scan(**a, **static, return_final_states=True, cu_seqlens=cu)
            return jnp.sum(y.astype(jnp.float32) * w) + jnp.sum(s * v)

        return f

    got = jax.jit(jax.grad(loss(xla_ssm.ssd)))(kw)
    want = jax.jit(jax.grad(loss(xla_ssm.ssd_ref)))(upcast(kw))
    for k in kw:
        assert got[k].dtype == kw[k].dtype and got[k].shape == kw[k].shape, k
        assert_close(f"d{k}", got[k], want[k], GRAD_TOL[dtype])


@pytest.mark.parametrize("d, limit", [(1, (0.0, np.inf)), (2, CLAMP)])
def test_packed_grads(d, limit):
    kw, cu = make_packed(62, PACKED_LENS, d=d)
    check_packed_grads(kw, cu, dict(chunk_size=32, dt_softplus=True, dt_limit=limit))


def test_packed_grad_with_traced_boundaries():
    """cu_seqlens as a jit argument: no gradient for it, and the others equal per-sequence ones."""
    kw, cu = make_packed(63, [5, 0, 30, 1], d=0, z=False)
    static = dict(chunk_size=32, dt_softplus=True)

    def loss(a, c):
        y, s = xla_ssm.ssd(**a, **static, return_final_states=True, cu_seqlens=c)
        return jnp.sum(y) + jnp.sum(s * s)

    got = jax.jit(jax.grad(loss))(kw, cu)
    for i in range(len(cu) - 1):
        one = sequence(kw, cu, i)

        def part(a):
            y, s = xla_ssm.ssd(**a, **static, return_final_states=True)
            return jnp.sum(y) + jnp.sum(s * s)

        want = jax.grad(part)(one)
        lo, hi = cu[i], cu[i + 1]
        for k in ("x", "dt", "B", "C"):
            assert_close(f"d{k} of sequence {i}", got[k][:, lo:hi], want[k], (1e-5, 1e-4))
        assert_close(f"dinitial_states {i}", got["initial_states"][i], want["initial_states"][0], (1e-5, 1e-4))


def test_packed_vmap():
    """vmap of packed calls (each example its own boundaries): one example at a time."""
    cases = [make_packed(70 + i, lens) for i, lens in enumerate([[3, 0, 20, 9], [1, 31, 0, 0]])]
    keys = list(cases[0][0])
    xs = {k: np.stack([c[0][k] for c in cases]) for k in keys}
    cus = np.stack([c[1] for c in cases])
    static = dict(chunk_size=32, dt_softplus=True, return_final_states=True)
    y, s = jax.jit(jax.vmap(lambda a, c: xla_ssm.ssd(**a, **static, cu_seqlens=c)))(xs, cus)
    for i, (kw, cu) in enumerate(cases):
        yr, sr = xla_ssm.ssd_ref(**kw, **static, cu_seqlens=cu)
        assert_close("y", y[i], yr, Y_TOL[F32])
        assert_close("final_states", s[i], sr, STATE_TOL[F32])


def test_packed_errors():
    kw, cu = make_packed(64, [4, 6])
    bad = [
        (dict(cu_seqlens=np.array([1, 4, 10], np.int32)), r"cu_seqlens must start at 0"),
        (dict(cu_seqlens=np.array([0, 6, 4, 10], np.int32)), r"never decrease"),
        (dict(cu_seqlens=np.array([0, 4, 9], np.int32)), r"end at seqlen \(= 10\)"),
        (dict(cu_seqlens=np.array([0.0, 4.0, 10.0], np.float32)), r"rank-1 integer array"),
        (dict(cu_seqlens=np.array([[0, 10]], np.int32)), r"rank-1 integer array"),
    ]
    for extra, match in bad:
        with pytest.raises(ValueError, match=match):
            xla_ssm.ssd(**kw, chunk_size=32, **extra)
    two = make_case(65, 2, 10, 4, 3, 5, 2, h0=False)
    with pytest.raises(ValueError, match=r"x must be \(1, seqlen, heads, headdim\)"):
        xla_ssm.ssd(**two, chunk_size=32, cu_seqlens=np.array([0, 10], np.int32))
    with pytest.raises(ValueError, match=r"initial_states must have shape \(num_seqs, heads, headdim, dstate\)"):
        xla_ssm.ssd(**{**kw, "initial_states": kw["initial_states"][:1]}, chunk_size=32, cu_seqlens=cu)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="only the CPU target reads traced boundaries")
def test_packed_traced_bad_boundaries_refused_by_the_cpu_target():
    kw, _ = make_packed(66, [4, 6])
    f = jax.jit(lambda c: xla_ssm.ssd(**kw, chunk_size=32, cu_seqlens=c))
    with pytest.raises(Exception, match=r"cu_seqlens"):
        jax.block_until_ready(f(np.array([0, 7, 5], np.int32)))
