"""The `xla_ssm_selective_scan_fwd` target through JAX, against the lax.scan reference.

Run: PYTHONPATH=bindings/python XLA_SSM_LIBRARY=target/release/libxla_ssm.so pytest tests/python
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_ssm
from xla_ssm import _lib

STATIC = ("delta_softplus", "layout")
fwd = jax.jit(xla_ssm.selective_scan_fwd, static_argnames=STATIC)
ref = jax.jit(xla_ssm.selective_scan_ref, static_argnames=STATIC)

F32, BF16, F16 = np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
DTYPES = {"f32": F32, "bf16": BF16, "f16": F16}
# (relative L2 error, max |error| / max |reference|) allowed for `out` in each dtype: the kernel
# accumulates in f32 like the reference, so the error of a half type is its final rounding.
OUT_TOL = {F32: (2e-5, 1e-4), BF16: (1e-2, 1e-2), F16: (2e-3, 2e-3)}
STATE_TOL = (2e-5, 1e-4)  # final_state is f32 in every case


@pytest.fixture(scope="module")
def lib():
    return xla_ssm.load()


# ------------------------------------------------------------------------------------ helpers
def make_case(
    seed,
    batch,
    dim,
    seqlen,
    dstate,
    groups=1,
    *,
    bc="var",
    dtype=F32,
    bc_dtype=None,
    layout="bdl",
    d=True,
    z=True,
    bias=True,
    h0=True,
    softplus=True,
):
    """Keyword arguments for selective_scan_fwd/ref: numpy arrays in the requested layout/dtypes."""
    rng = np.random.default_rng(seed)

    def randn(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    u = randn(batch, dim, seqlen)
    if softplus:
        delta = 0.5 * randn(batch, dim, seqlen) - 1.0
    else:
        delta = rng.uniform(0.01, 0.5, (batch, dim, seqlen)).astype(np.float32)
    A = -rng.uniform(0.5, 4.0, (dim, dstate)).astype(np.float32)
    if bc == "var":
        B, C = randn(batch, groups, dstate, seqlen), randn(batch, groups, dstate, seqlen)
    else:
        B, C = randn(dim, dstate), randn(dim, dstate)
    kw = dict(u=u, delta=delta, A=A, B=B, C=C, delta_softplus=softplus, layout=layout)
    if d:
        kw["D"] = randn(dim)
    if z:
        kw["z"] = randn(batch, dim, seqlen)
    if bias:
        kw["delta_bias"] = rng.uniform(-0.5, 0.5, dim).astype(np.float32)
    if h0:
        kw["initial_state"] = randn(batch, dim, dstate)
    if layout == "bld":
        for k in ("u", "delta", "z"):
            if k in kw:
                kw[k] = np.ascontiguousarray(kw[k].transpose(0, 2, 1))
        if bc == "var":
            kw["B"] = np.ascontiguousarray(kw["B"].transpose(0, 3, 1, 2))
            kw["C"] = np.ascontiguousarray(kw["C"].transpose(0, 3, 1, 2))
    for k in ("u", "delta", "z"):
        if k in kw:
            kw[k] = kw[k].astype(dtype)
    bc_dtype = dtype if bc_dtype is None else bc_dtype
    kw["B"], kw["C"] = kw["B"].astype(bc_dtype), kw["C"].astype(bc_dtype)
    return kw


def upcast(kw):
    return {k: v.astype(np.float32) if isinstance(v, np.ndarray) else v for k, v in kw.items()}


def assert_close(name, got, want, tol):
    rel_l2, rel_max = tol
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
    if want.size == 0:
        return
    assert np.isfinite(got).all(), f"{name}: {np.size(got) - np.isfinite(got).sum()} non-finite values"
    diff = got - want
    scale = max(np.abs(want).max(), 1e-30)
    rel = np.linalg.norm(diff) / max(np.linalg.norm(want), 1e-30)
    mx = np.abs(diff).max()
    where = np.unravel_index(np.abs(diff).argmax(), diff.shape)
    assert rel <= rel_l2, f"{name}: relative L2 error {rel:.3g} > {rel_l2:.3g} (max |err| {mx:.3g} at {where})"
    assert mx <= rel_max * scale, (
        f"{name}: max |err| {mx:.3g} at {where} > {rel_max:.3g} * max|ref| ({scale:.3g})"
    )


def check(kw):
    """Run our target (jitted) and the f32 reference on upcast inputs; compare both results."""
    out, state = fwd(**kw)
    out_ref, state_ref = ref(**upcast(kw))
    u = kw["u"]
    assert out.dtype == u.dtype and out.shape == u.shape
    layout = kw["layout"]
    batch, dim = (u.shape[0], u.shape[1]) if layout == "bdl" else (u.shape[0], u.shape[2])
    assert state.dtype == jnp.float32 and state.shape == (batch, dim, kw["A"].shape[1])
    assert_close("out", out, out_ref, OUT_TOL[np.dtype(u.dtype)])
    assert_close("final_state", state, state_ref, STATE_TOL)
    return out, state


# ------------------------------------------------------------------------------------ shapes
# (batch, dim, seqlen, dstate, groups, B/C form)
SHAPES = [
    pytest.param(2, 8, 17, 16, 1, "var", id="odd-seqlen"),
    pytest.param(1, 4, 1, 16, 1, "var", id="seqlen1"),
    pytest.param(2, 4, 0, 16, 1, "var", id="seqlen0"),
    pytest.param(2, 6, 9, 1, 3, "var", id="dstate1-g3"),
    pytest.param(1, 8, 33, 64, 2, "var", id="dstate64-g2"),
    pytest.param(1, 4, 12, 256, 4, "var", id="dstate256-g4"),
    pytest.param(3, 5, 23, 16, 5, "var", id="g=dim"),
    pytest.param(2, 8, 13, 16, 1, "inv", id="time-invariant"),
    pytest.param(1, 3, 5, 7, 1, "inv", id="time-invariant-odd"),
    pytest.param(0, 4, 5, 16, 1, "var", id="batch0"),
    pytest.param(2, 0, 5, 16, 1, "var", id="dim0"),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ["bdl", "bld"])
@pytest.mark.parametrize("batch,dim,seqlen,dstate,groups,bc", SHAPES)
def test_shapes(lib, batch, dim, seqlen, dstate, groups, bc, layout, dtype):
    kw = make_case(1, batch, dim, seqlen, dstate, groups, bc=bc, dtype=DTYPES[dtype], layout=layout)
    check(kw)


@pytest.mark.compat
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("bc", ["var", "inv"])
def test_half_inputs_with_f32_b_c(lib, dtype, bc):
    kw = make_case(2, 2, 8, 21, 16, 2 if bc == "var" else 1, bc=bc, dtype=DTYPES[dtype], bc_dtype=F32)
    check(kw)


# Every combination of (D, z, delta_bias, initial state, softplus); scripts/compat.sh's smoke subset
# takes none and all of them.
OPTIONS = [
    pytest.param(
        *o,
        id="".join(f"{n}{int(v)}" for n, v in zip(("D", "z", "b", "h", "sp"), o)),
        marks=[pytest.mark.compat] if len(set(o)) == 1 else [],
    )
    for o in itertools.product([False, True], repeat=5)
]


@pytest.mark.parametrize("layout", ["bdl", "bld"])
@pytest.mark.parametrize("d,z,bias,h0,softplus", OPTIONS)
def test_options(lib, d, z, bias, h0, softplus, layout):
    kw = make_case(3, 2, 8, 19, 8, 2, layout=layout, d=d, z=z, bias=bias, h0=h0, softplus=softplus)
    check(kw)


def test_seqlen0_final_state_is_initial_state(lib):
    for h0 in (True, False):
        kw = make_case(4, 2, 4, 0, 16, h0=h0)
        out, state = fwd(**kw)
        assert out.shape == (2, 4, 0)
        want = kw["initial_state"] if h0 else np.zeros((2, 4, 16), np.float32)
        np.testing.assert_array_equal(np.asarray(state), want)


def test_softplus_large_delta(lib):
    """softplus(x) = x for x > 20: large dt must not overflow."""
    kw = make_case(5, 1, 4, 6, 4, bias=False)
    kw["delta"] = (kw["delta"] + 30.0).astype(np.float32)
    check(kw)


@pytest.mark.compat
def test_eager_matches_jit(lib):
    kw = make_case(6, 2, 8, 10, 16, 2)
    out_j, state_j = fwd(**kw)
    out_e, state_e = xla_ssm.selective_scan_fwd(**kw)
    np.testing.assert_array_equal(np.asarray(out_e), np.asarray(out_j))
    np.testing.assert_array_equal(np.asarray(state_e), np.asarray(state_j))


@pytest.mark.compat
def test_vmap(lib):
    kws = [make_case(7 + i, 2, 4, 9, 8) for i in range(3)]
    stacked = {k: np.stack([kw[k] for kw in kws]) for k in ("u", "delta", "B", "C", "z", "initial_state")}
    shared = {k: kws[0][k] for k in ("A", "D", "delta_bias")}

    def f(s):
        return xla_ssm.selective_scan_fwd(**s, **shared, delta_softplus=True)

    out, state = jax.jit(jax.vmap(f))(stacked)
    for i in range(3):
        kw = dict(kws[i], A=shared["A"], D=shared["D"], delta_bias=shared["delta_bias"])
        o, s = fwd(**kw)
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(o), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(state[i]), np.asarray(s), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------- the reference itself
def numpy_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
              initial_state=None, layout="bdl"):
    """float64 loop written from docs/selective_scan_fwd.md; channel-first layout only."""
    assert layout == "bdl"
    u, delta, A, B, C = (np.asarray(x, np.float64) for x in (u, delta, A, B, C))
    batch, dim, seqlen = u.shape
    dt = delta + (0 if delta_bias is None else np.asarray(delta_bias, np.float64)[None, :, None])
    if delta_softplus:
        dt = np.where(dt > 20, dt, np.log1p(np.exp(np.minimum(dt, 20))))
    if B.ndim == 4:
        rep = dim // B.shape[1]
        Bx, Cx = np.repeat(B, rep, axis=1), np.repeat(C, rep, axis=1)  # (batch, dim, dstate, L)
    else:
        Bx = np.broadcast_to(B[None, :, :, None], (batch, *B.shape, seqlen))
        Cx = np.broadcast_to(C[None, :, :, None], (batch, *C.shape, seqlen))
    h = np.zeros((batch, dim, A.shape[1])) if initial_state is None else np.array(initial_state, np.float64)
    y = np.zeros_like(u)
    for t in range(seqlen):
        h = np.exp(dt[:, :, t, None] * A) * h + (dt[:, :, t] * u[:, :, t])[..., None] * Bx[..., t]
        y[:, :, t] = (Cx[..., t] * h).sum(-1)
    if D is not None:
        y += np.asarray(D, np.float64)[None, :, None] * u
    if z is not None:
        z = np.asarray(z, np.float64)
        y *= z / (1 + np.exp(-z))
    return y, h


@pytest.mark.parametrize("bc,groups", [("var", 1), ("var", 2), ("inv", 1)])
@pytest.mark.parametrize("layout", ["bdl", "bld"])
def test_reference_matches_numpy(bc, groups, layout):
    kw = make_case(8, 2, 4, 11, 8, groups, bc=bc, layout=layout)
    out, state = ref(**kw)
    bdl = make_case(8, 2, 4, 11, 8, groups, bc=bc, layout="bdl")
    want_out, want_state = numpy_ref(**bdl)
    if layout == "bld":
        want_out = want_out.transpose(0, 2, 1)
    assert_close("ref out", out, want_out, (1e-5, 1e-5))
    assert_close("ref final_state", state, want_state, (1e-5, 1e-5))


# ------------------------------------------------------------------ validation in Python
def _bad(change):
    kw = make_case(9, 2, 8, 5, 4, 2)
    change(kw)
    return kw


BAD = [
    ("u-f64", lambda kw: kw.update(u=kw["u"].astype(np.float64)), TypeError, "u must be float32"),
    ("u-int", lambda kw: kw.update(u=kw["u"].astype(np.int32)), TypeError, "u must be float32"),
    ("u-rank2", lambda kw: kw.update(u=kw["u"][0]), ValueError, "u must have rank 3"),
    ("delta-dtype", lambda kw: kw.update(delta=kw["delta"].astype(F16)), TypeError, "delta must have the dtype of u"),
    ("delta-shape", lambda kw: kw.update(delta=kw["delta"][:, :, :4]), ValueError, "delta must have the shape of u"),
    ("A-dtype", lambda kw: kw.update(A=kw["A"].astype(BF16)), TypeError, "A must be float32"),
    ("A-dim", lambda kw: kw.update(A=kw["A"][:4]), ValueError, "A must have shape"),
    ("A-dstate0", lambda kw: kw.update(A=kw["A"][:, :0]), ValueError, "dstate"),
    ("B-dtype", lambda kw: kw.update(B=kw["B"].astype(F16), C=kw["C"].astype(F16)), TypeError, "B and C must be"),
    ("B-rank3", lambda kw: kw.update(B=kw["B"][0], C=kw["C"][0]), ValueError, "B must have rank 2"),
    ("B-seqlen", lambda kw: kw.update(B=kw["B"][..., :3], C=kw["C"][..., :3]), ValueError, "B must have shape"),
    ("groups", lambda kw: kw.update(B=np.zeros((2, 3, 4, 5), np.float32), C=np.zeros((2, 3, 4, 5), np.float32)),
     ValueError, "multiple of groups"),
    ("C-unlike-B", lambda kw: kw.update(C=kw["C"][:, :1]), ValueError, "C must have the shape and dtype of B"),
    ("D-shape", lambda kw: kw.update(D=kw["D"][:3]), ValueError, "D must have shape"),
    ("D-dtype", lambda kw: kw.update(D=kw["D"].astype(BF16)), TypeError, "D must be float32"),
    ("z-dtype", lambda kw: kw.update(z=kw["z"].astype(BF16)), TypeError, "z must have the dtype of u"),
    ("bias-shape", lambda kw: kw.update(delta_bias=kw["delta_bias"][None]), ValueError, "delta_bias must have shape"),
    ("h0-shape", lambda kw: kw.update(initial_state=kw["initial_state"][:1]), ValueError,
     "initial_state must have shape"),
    ("h0-dtype", lambda kw: kw.update(initial_state=kw["initial_state"].astype(F16)), TypeError,
     "initial_state must be float32"),
    ("layout", lambda kw: kw.update(layout="lbd"), ValueError, "layout must be one of"),
    ("softplus", lambda kw: kw.update(delta_softplus="yes"), TypeError, "delta_softplus must be a Python bool"),
]


@pytest.mark.parametrize("change,exc,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_in_python(change, exc, match):
    kw = _bad(change)
    with pytest.raises(exc, match=match):
        xla_ssm.selective_scan_fwd(**kw)
    if kw["u"].dtype == np.float64:
        return  # jit turns float64 arguments into float32 when x64 is off: nothing to reject there
    with pytest.raises(exc, match=match):
        fwd(**kw)


def test_traced_softplus_flag_is_rejected():
    kw = make_case(10, 1, 4, 3, 4)
    f = jax.jit(lambda sp: xla_ssm.selective_scan_fwd(**{**kw, "delta_softplus": sp}))
    with pytest.raises(TypeError, match="delta_softplus"):
        f(True)


# -------------------------------------------------- validation in the library (XLA errors)
def raw_call(ops, *, out_shape, state_shape, softplus=True, has=(True, True, True, True), layout="bdl"):
    """jax.ffi.ffi_call straight to the target, with no Python checks."""
    call = jax.ffi.ffi_call(
        "xla_ssm_selective_scan_fwd",
        (jax.ShapeDtypeStruct(out_shape, ops[0].dtype), jax.ShapeDtypeStruct(state_shape, jnp.float32)),
        vmap_method="sequential",
    )
    d, z, b, h = has
    return call(
        *ops,
        delta_softplus=np.bool_(softplus),
        has_d=np.bool_(d),
        has_z=np.bool_(z),
        has_delta_bias=np.bool_(b),
        has_initial_state=np.bool_(h),
        layout=layout,
    )


ORDER = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")
RAW_BAD = [
    # (id, change to the keyword arguments, layout attribute, what the XLA error must name)
    ("delta_bias-shape", lambda kw: kw.update(delta_bias=np.zeros(9, np.float32)), "bdl", "delta_bias"),
    ("initial_state-dtype", lambda kw: kw.update(initial_state=kw["initial_state"].astype(F16)), "bdl",
     "initial_state"),
    ("A-dtype", lambda kw: kw.update(A=kw["A"].astype(F16)), "bdl", "A"),
    ("z-shape", lambda kw: kw.update(z=kw["z"][:, :, :4]), "bdl", "z"),
    ("B-dtype", lambda kw: kw.update(B=kw["B"].astype(F16), C=kw["C"].astype(F16)), "bdl", "B"),
    ("delta-dtype", lambda kw: kw.update(delta=kw["delta"].astype(BF16)), "bdl", "delta"),
    ("layout-attr", lambda kw: None, "xyz", "layout"),
]


@pytest.mark.compat
@pytest.mark.parametrize("change,layout,match", [b[1:] for b in RAW_BAD], ids=[b[0] for b in RAW_BAD])
def test_bad_input_raises_in_library(lib, change, layout, match):
    kw = make_case(11, 2, 8, 5, 4, 2)
    change(kw)
    ops = [kw[k] for k in ORDER]
    f = jax.jit(lambda *ops: raw_call(ops, out_shape=(2, 8, 5), state_shape=(2, 8, 4), layout=layout))
    # INVALID_ARGUMENT, the operand's (or attribute's) name, what was expected and what came.
    pattern = rf"(?s)INVALID_ARGUMENT.*\b{match}\b.*expected.*got"
    with pytest.raises(jax.errors.JaxRuntimeError, match=pattern):
        jax.block_until_ready(f(*ops))


@pytest.mark.compat
def test_good_raw_call_works(lib):
    """The raw call above with untouched operands runs: the failures come from the changes."""
    kw = make_case(11, 2, 8, 5, 4, 2)
    out, state = raw_call([kw[k] for k in ORDER], out_shape=(2, 8, 5), state_shape=(2, 8, 4))
    want_out, want_state = fwd(**kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(state), np.asarray(want_state))


# --------------------------------------------------------------------------- the library
def test_registered_platforms(lib):
    platforms = xla_ssm.registered_platforms()
    assert "cpu" in platforms
    assert ("CUDA" in platforms) == hasattr(lib, "xla_ssm_selective_scan_fwd_cuda")


def test_missing_library_error_lists_paths(tmp_path, monkeypatch):
    missing = tmp_path / "nope" / "libxla_ssm.so"
    monkeypatch.setenv("XLA_SSM_LIBRARY", str(missing))
    with pytest.raises(FileNotFoundError, match="looked in") as info:
        _lib.find_library()
    assert str(missing) in str(info.value)
    monkeypatch.delenv("XLA_SSM_LIBRARY")
    paths = _lib.candidate_paths()
    assert paths[0].parent.name == "xla_ssm"
    assert paths[-1].parts[-3:] == ("target", "release", "libxla_ssm.so")


def test_import_does_not_load_library():
    """Importing the package (e.g. for the reference) needs no library."""
    code = (
        "import os; os.environ['XLA_SSM_LIBRARY'] = '/nonexistent/libxla_ssm.so'\n"
        "import xla_ssm, numpy as np\n"
        "out, h = xla_ssm.selective_scan_ref(np.ones((1, 2, 3), np.float32), np.ones((1, 2, 3), np.float32),"
        " -np.ones((2, 4), np.float32), np.ones((2, 4), np.float32), np.ones((2, 4), np.float32))\n"
        "assert out.shape == (1, 2, 3) and h.shape == (1, 2, 4)\n"
        "try:\n"
        "    xla_ssm.load()\n"
        "except FileNotFoundError as e:\n"
        "    assert '/nonexistent/libxla_ssm.so' in str(e); print('ok')\n"
    )
    pkg_root = str(Path(xla_ssm.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
