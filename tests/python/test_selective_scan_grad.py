"""`xla_ssm.selective_scan`: gradients (custom_vjp over `xla_ssm_selective_scan_bwd`) against jax.grad
of the lax.scan reference, vmap (folded into one call), extra leading dims, and the checks in Python.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_ssm
from test_selective_scan_jax import BF16, F32, OPTIONS, assert_close, make_case, upcast
from xla_ssm import _scan


ARRAYS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")
STATIC = ("delta_softplus", "layout")
# Gradient tolerances (relative L2, max |err| / max |ref|): f32 against the f32 reference differs by
# summation order; a half type by its input and output rounding.
GRAD_TOL = {F32: (1e-4, 1e-3), BF16: (3e-2, 6e-2)}


def split(kw):
    arrays = {k: v for k, v in kw.items() if k in ARRAYS}
    static = {k: v for k, v in kw.items() if k not in ARRAYS}
    return arrays, static


def cotangents(seed, kw, dtype):
    """Random weights for the loss, representable in the output dtype (so both sides see the same)."""
    rng = np.random.default_rng(seed)
    u, A = kw["u"], kw["A"]
    w = rng.standard_normal(u.shape).astype(dtype).astype(np.float32)
    batch, dim = (u.shape[0], u.shape[1]) if kw["layout"] == "bdl" else (u.shape[0], u.shape[2])
    v = rng.standard_normal((batch, dim, A.shape[1])).astype(np.float32)
    return w, v


def loss_fn(scan, static, w, v, final):
    def loss(arrays):
        if final:
            out, h = scan(**arrays, **static, return_final_state=True)
            return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(h * v)
        out = scan(**arrays, **static)
        return jnp.sum(out.astype(jnp.float32) * w)

    return loss


def ref_scan(return_final_state=False, **kw):
    out, h = xla_ssm.selective_scan_ref(**kw)
    return (out, h) if return_final_state else out


def check_grads(kw, final=True, seed=0):
    arrays, static = split(kw)
    dtype = np.dtype(kw["u"].dtype)
    w, v = cotangents(seed, kw, dtype)
    ours = jax.jit(jax.grad(loss_fn(xla_ssm.selective_scan, static, w, v, final)))(arrays)
    want = jax.jit(jax.grad(loss_fn(ref_scan, static, w, v, final)))(upcast(arrays))
    for k in arrays:
        assert ours[k].dtype == arrays[k].dtype, f"d{k}: dtype {ours[k].dtype}, primal {arrays[k].dtype}"
        assert ours[k].shape == arrays[k].shape
        assert_close(f"d{k}", ours[k], want[k], GRAD_TOL[dtype])
    return ours


# ------------------------------------------------------------------------------- gradients
GRAD_SHAPES = [  # (batch, dim, seqlen, dstate, groups, B/C form)
    pytest.param(2, 8, 17, 16, 1, "var", id="odd-seqlen"),
    pytest.param(1, 4, 130, 8, 2, "var", id="3-checkpoints"),
    pytest.param(1, 4, 128, 4, 1, "var", id="2-full-checkpoints"),
    pytest.param(2, 6, 9, 1, 3, "var", id="dstate1-g3"),
    pytest.param(1, 4, 12, 256, 4, "var", id="dstate256-g4"),
    pytest.param(2, 8, 70, 16, 1, "inv", id="time-invariant"),
    pytest.param(1, 3, 5, 7, 1, "inv", id="time-invariant-odd"),
    pytest.param(2, 4, 0, 8, 1, "var", id="seqlen0"),
    pytest.param(0, 4, 5, 8, 1, "var", id="batch0"),
]


@pytest.mark.parametrize("layout", ["bdl", "bld"])
@pytest.mark.parametrize("batch,dim,seqlen,dstate,groups,bc", GRAD_SHAPES)
def test_grad_shapes(batch, dim, seqlen, dstate, groups, bc, layout):
    kw = make_case(20, batch, dim, seqlen, dstate, groups, bc=bc, layout=layout)
    check_grads(kw, final=True)


@pytest.mark.compat
@pytest.mark.parametrize(
    "bc,bc_dtype,layout",
    [("var", None, "bdl"), ("var", F32, "bld"), ("inv", None, "bld"), ("inv", F32, "bdl")],
    ids=["var-bc-bf16-bdl", "var-bc-f32-bld", "inv-bc-bf16-bld", "inv-bc-f32-bdl"],
)
def test_grad_bf16(bc, bc_dtype, layout):
    kw = make_case(21, 2, 8, 40, 16, 2 if bc == "var" else 1, bc=bc, dtype=BF16, bc_dtype=bc_dtype, layout=layout)
    check_grads(kw, final=True)


@pytest.mark.parametrize("d,z,bias,h0,softplus", OPTIONS)
def test_grad_options(d, z, bias, h0, softplus):
    # Layout and return_final_state vary with the options instead of multiplying the count (every
    # pair of values meets); the layouts get their own shapes sweep above.
    layout = "bdl" if (d + z + bias) % 2 else "bld"
    final = bool((z + h0 + softplus) % 2)
    kw = make_case(22, 2, 4, 19, 8, 2, layout=layout, d=d, z=z, bias=bias, h0=h0, softplus=softplus)
    check_grads(kw, final=final)


@pytest.mark.parametrize("used", ["out", "final_state"])
def test_one_result_in_the_loss(used):
    """return_final_state=True and a loss of one result: the other's cotangent is a symbolic zero.
    An unused final state passes no dfinal_state to the backward; a final state alone drives every
    gradient (the output's cotangent is zeros)."""
    kw = make_case(23, 2, 4, 70, 8, 1)
    arrays, static = split(kw)
    w, v = cotangents(0, kw, F32)

    def loss(scan):
        def f(a):
            out, h = scan(**a, **static, return_final_state=True)
            return jnp.sum(out * w) if used == "out" else jnp.sum(h * v)

        return f

    grad = jax.jit(jax.grad(loss(xla_ssm.selective_scan)))
    passed = re.findall(r"has_dfinal_state = (\w+)", grad.lower(arrays).as_text())
    assert passed == [str(used == "final_state").lower()]
    ours = grad(arrays)
    want = jax.jit(jax.grad(loss(ref_scan)))(arrays)
    for k in arrays:
        assert_close(f"d{k}", ours[k], want[k], GRAD_TOL[F32])
    assert np.abs(np.asarray(ours["u"])).max() > 0


def test_checkpoints_match_reference():
    """The forward's checkpoint k is the state entering step k * CHECKPOINT_LEN (h0 first)."""
    L = 2 * _scan.CHECKPOINT_LEN + 5
    kw = make_case(24, 2, 4, L, 8, 2)
    arrays, static = split(kw)
    cfg = _scan._Cfg(True, "bdl", 4, True, True, True, True, True)
    ops = [arrays[k] for k in ARRAYS]
    out, h, ck = jax.jit(lambda *o: _scan._raw(_scan._Call("fwd", cfg, _scan.CHECKPOINT_LEN), *o))(*ops)
    assert ck.shape == (2, 4, 3, 8) and ck.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ck[:, :, 0]), arrays["initial_state"])
    for k in (1, 2):
        t = k * _scan.CHECKPOINT_LEN
        cut = dict(arrays, u=arrays["u"][..., :t], delta=arrays["delta"][..., :t], z=arrays["z"][..., :t],
                   B=arrays["B"][..., :t], C=arrays["C"][..., :t])
        _, want = xla_ssm.selective_scan_ref(**cut, **static)
        assert_close(f"checkpoint {k}", ck[:, :, k], want, (2e-5, 1e-4))


def test_grad_jit_combinations():
    kw = make_case(25, 2, 4, 33, 8, 2)
    arrays, static = split(kw)
    w, v = cotangents(0, kw, F32)
    loss = loss_fn(xla_ssm.selective_scan, static, w, v, True)
    a = jax.grad(loss)(arrays)  # eager
    b = jax.jit(jax.grad(loss))(arrays)
    c = jax.grad(jax.jit(loss))(arrays)
    val, d = jax.jit(jax.value_and_grad(loss))(arrays)
    for k in arrays:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(c[k]), np.asarray(b[k]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(d[k]), np.asarray(b[k]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(val), float(loss(arrays)), rtol=1e-5)


def test_grad_deterministic():
    kw = make_case(26, 2, 8, 100, 16, 2)
    arrays, static = split(kw)
    w, v = cotangents(0, kw, F32)
    g = jax.jit(jax.grad(loss_fn(xla_ssm.selective_scan, static, w, v, True)))
    a, b = g(arrays), g(arrays)
    for k in arrays:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))


# ------------------------------------------------------------------------------------ vmap
def stack(kws, keys):
    return {k: np.stack([kw[k] for kw in kws]) for k in keys}


EXAMPLE = ("u", "delta", "B", "C", "z", "initial_state")
PARAMS = ("A", "D", "delta_bias")


def per_example(seed0, n, **kw):
    return [make_case(seed0 + i, 2, 4, 11, 8, 2, **kw) for i in range(n)]


@pytest.mark.parametrize("mapped_params", [False, True], ids=["shared-params", "mapped-params"])
@pytest.mark.parametrize("layout", ["bdl", "bld"])
def test_vmap_forward(mapped_params, layout):
    kws = per_example(30, 3, layout=layout)
    mapped = EXAMPLE + (PARAMS if mapped_params else ())
    xs = stack(kws, mapped)
    shared = {k: kws[0][k] for k in ARRAYS if k not in mapped}

    def f(x):
        return xla_ssm.selective_scan(**x, **shared, delta_softplus=True, layout=layout, return_final_state=True)

    out, h = jax.jit(jax.vmap(f))(xs)
    for i in range(3):
        o, s = xla_ssm.selective_scan_ref(**{k: kws[i][k] for k in mapped}, **shared, delta_softplus=True, layout=layout)
        assert_close("out", out[i], o, (2e-5, 1e-4))
        assert_close("final_state", h[i], s, (2e-5, 1e-4))


def test_vmap_forward_one_call():
    """vmap folds into a single FFI call (no sequential loop) in both ways of folding."""
    kws = per_example(31, 3)
    for mapped in (EXAMPLE, EXAMPLE + PARAMS):
        xs = stack(kws, mapped)
        shared = {k: kws[0][k] for k in ARRAYS if k not in mapped}
        f = jax.vmap(lambda x: xla_ssm.selective_scan(**x, **shared, delta_softplus=True))  # noqa: B023
        hlo = jax.jit(f).lower(xs).as_text()
        assert hlo.count("xla_ssm_selective_scan_fwd") == 1, hlo
        assert "while" not in hlo


def test_vmap_nested_and_axes():
    """vmap of vmap, in_axes other than 0, and a mapped B with an unmapped u."""
    kws = [per_example(40 + 3 * j, 3) for j in range(2)]
    xs = {k: np.stack([stack(row, EXAMPLE)[k] for row in kws]) for k in EXAMPLE}  # (2, 3, ...)
    shared = {k: kws[0][0][k] for k in PARAMS}

    def f(x):
        return xla_ssm.selective_scan(**x, **shared, delta_softplus=True)

    out = jax.jit(jax.vmap(jax.vmap(f)))(xs)
    # in_axes=1: the 2 sits second.
    out_t = jax.vmap(jax.vmap(f), in_axes=1, out_axes=1)({k: np.swapaxes(v, 0, 1) for k, v in xs.items()})
    np.testing.assert_allclose(np.asarray(out_t), np.asarray(out).swapaxes(0, 1), rtol=1e-6, atol=1e-6)
    ref = jax.jit(jax.vmap(jax.vmap(lambda x: xla_ssm.selective_scan_ref(**x, **shared, delta_softplus=True)[0])))
    assert_close("out", out, ref(xs), (2e-5, 1e-4))
    # Only B and C mapped: u, delta, z, initial_state are broadcast to each.
    base = kws[0][0]
    bc = stack(kws[1], ("B", "C"))
    rest = {k: base[k] for k in ARRAYS if k not in ("B", "C")}
    out = jax.vmap(lambda b: xla_ssm.selective_scan(**b, **rest, delta_softplus=True))(bc)
    for i in range(3):
        o, _ = xla_ssm.selective_scan_ref(**rest, B=bc["B"][i], C=bc["C"][i], delta_softplus=True)
        assert_close("out", out[i], o, (2e-5, 1e-4))


@pytest.mark.compat
@pytest.mark.parametrize("mapped_params", [False, True], ids=["shared-params", "mapped-params"])
def test_vmap_of_grad(mapped_params):
    """Per-example gradients, shared parameters included (each example gets its own dA, dD, ...)."""
    kws = per_example(50, 3)
    mapped = EXAMPLE + (PARAMS if mapped_params else ())
    xs = stack(kws, mapped)
    shared = {k: kws[0][k] for k in ARRAYS if k not in mapped}
    w, v = cotangents(0, kws[0], F32)

    def grads(scan):
        def loss(x, s):
            return loss_fn(scan, {"delta_softplus": True, "layout": "bdl"}, w, v, True)({**x, **s})

        return jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))

    gx, gs = grads(xla_ssm.selective_scan)(xs, shared)
    ref_grad = jax.jit(jax.grad(loss_fn(ref_scan, {"delta_softplus": True, "layout": "bdl"}, w, v, True)))
    for i in range(3):
        want = ref_grad({**{k: kws[i][k] for k in mapped}, **shared})
        for k in mapped:
            assert_close(f"d{k}[{i}]", gx[k][i], want[k], GRAD_TOL[F32])
        for k in shared:
            assert_close(f"d{k}[{i}]", gs[k][i], want[k], GRAD_TOL[F32])


@pytest.mark.parametrize("mapped_params", [False, True], ids=["shared-params", "mapped-params"])
def test_grad_of_vmap(mapped_params):
    kws = per_example(60, 3)
    mapped = EXAMPLE + (PARAMS if mapped_params else ())
    xs = stack(kws, mapped)
    shared = {k: kws[0][k] for k in ARRAYS if k not in mapped}

    def total(scan):
        def f(x, s):
            out = jax.vmap(lambda e: scan(**e, **s, delta_softplus=True), in_axes=0)(x)
            return jnp.sum(jnp.sin(out))

        return jax.jit(jax.grad(f, argnums=(0, 1)))

    ours = total(xla_ssm.selective_scan)(xs, shared)
    want = total(ref_scan)(xs, shared)
    for part, w in zip(ours, want):
        for k in part:
            assert_close(f"d{k}", part[k], w[k], GRAD_TOL[F32])


# ------------------------------------------------------------------------- leading dims
@pytest.mark.parametrize("shared_bc", [False, True])
@pytest.mark.parametrize("layout", ["bdl", "bld"])
def test_leading_dims(shared_bc, layout):
    """u of shape (2, 3, batch, dim, seqlen): one call, like looping over the leading dims."""
    kws = [per_example(70 + 3 * j, 3, layout=layout) for j in range(2)]
    keys = ("u", "delta", "z", "initial_state") + (() if shared_bc else ("B", "C"))
    xs = {k: np.stack([stack(row, keys)[k] for row in kws]) for k in keys}
    rest = {k: kws[0][0][k] for k in ARRAYS if k not in keys}
    out, h = xla_ssm.selective_scan(**xs, **rest, delta_softplus=True, layout=layout, return_final_state=True)
    assert out.shape == xs["u"].shape and h.shape == xs["initial_state"].shape
    for j in range(2):
        for i in range(3):
            o, s = xla_ssm.selective_scan_ref(
                **{k: xs[k][j, i] for k in keys}, **rest, delta_softplus=True, layout=layout
            )
            assert_close("out", out[j, i], o, (2e-5, 1e-4))
            assert_close("final_state", h[j, i], s, (2e-5, 1e-4))


def test_leading_dims_grad():
    kws = per_example(80, 3)
    keys = ("u", "delta", "z")  # B, C, initial_state shared: their gradients sum over the leading dim
    xs = stack(kws, keys)
    rest = {k: kws[0][k] for k in ARRAYS if k not in keys}

    def loss(scan, x, r):
        if scan is ref_scan:  # the reference has no leading dims: loop
            outs = [scan(**{k: x[k][i] for k in keys}, **r, delta_softplus=True) for i in range(3)]
            out = jnp.stack(outs)
        else:
            out = scan(**x, **r, delta_softplus=True)
        return jnp.sum(jnp.cos(out))

    ours = jax.jit(jax.grad(lambda x, r: loss(xla_ssm.selective_scan, x, r), argnums=(0, 1)))(xs, rest)
    want = jax.jit(jax.grad(lambda x, r: loss(ref_scan, x, r), argnums=(0, 1)))(xs, rest)
    for part, w in zip(ours, want):
        for k in part:
            assert_close(f"d{k}", part[k], w[k], GRAD_TOL[F32])


# ---------------------------------------------------------------------- checks in Python
def _case():
    kw = make_case(90, 2, 8, 5, 4, 2)
    return split(kw)


LEAD_BAD = [
    ("delta-lead", lambda a: a.update(u=np.stack([a["u"]] * 2), delta=a["delta"]), ValueError,
     r"delta must have the shape of u \(2, 2, 8, 5\)"),
    ("B-lead", lambda a: a.update(u=np.stack([a["u"]] * 2), delta=np.stack([a["delta"]] * 2),
                                  z=np.stack([a["z"]] * 2), B=np.stack([a["B"]] * 3)), ValueError,
     r"B must have u's leading dims \(2,\)"),
    ("C-lead", lambda a: a.update(u=np.stack([a["u"]] * 2), delta=np.stack([a["delta"]] * 2),
                                  z=np.stack([a["z"]] * 2), B=np.stack([a["B"]] * 2)), ValueError,
     r"C must have the shape of B"),
    ("h0-lead", lambda a: a.update(u=np.stack([a["u"]] * 2), delta=np.stack([a["delta"]] * 2),
                                   z=np.stack([a["z"]] * 2), initial_state=np.stack([a["initial_state"]] * 3)),
     ValueError, r"initial_state must have u's leading dims"),
    ("A-lead", lambda a: a.update(u=np.stack([a["u"]] * 2), delta=np.stack([a["delta"]] * 2),
                                  z=np.stack([a["z"]] * 2), A=np.stack([a["A"]] * 2)), ValueError,
     r"A must have shape \(dim=8, dstate\)"),
    ("u-rank2", lambda a: a.update(u=a["u"][0]), ValueError, r"u must have rank 3"),
    ("B-f16", lambda a: a.update(B=a["B"].astype(np.float16), C=a["C"].astype(np.float16)), TypeError,
     r"B and C must be float32 or the dtype of u"),
]


@pytest.mark.parametrize("change,exc,match", [b[1:] for b in LEAD_BAD], ids=[b[0] for b in LEAD_BAD])
def test_bad_input_raises_in_python(change, exc, match):
    arrays, static = _case()
    change(arrays)
    with pytest.raises(exc, match=match):
        xla_ssm.selective_scan(**arrays, **static)
    # Under jit and grad too: raised while tracing, before XLA sees anything.
    with pytest.raises(exc, match=match):
        jax.jit(jax.grad(lambda a: jnp.sum(xla_ssm.selective_scan(**a, **static))))(arrays)


def test_return_final_state_must_be_static():
    arrays, static = _case()
    with pytest.raises(TypeError, match="return_final_state must be a Python bool"):
        jax.jit(lambda a, f: xla_ssm.selective_scan(**a, **static, return_final_state=f))(arrays, True)


def test_results_and_dtypes():
    arrays, static = _case()
    out = xla_ssm.selective_scan(**arrays, **static)
    assert isinstance(out, jax.Array) and out.shape == arrays["u"].shape
    out2, h = xla_ssm.selective_scan(**arrays, **static, return_final_state=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))
    assert h.shape == (2, 8, 4) and h.dtype == jnp.float32
