"""The decode-time targets through JAX: against the jnp references, a 64-token decode against the
full-sequence scan, gradients of causal_conv1d against jax.grad of the reference, in-place
(donated) states, and Python-side errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_ssm

F32, BF16 = jnp.float32, jnp.bfloat16


def rnd(rng, shape, dtype=F32, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def close(got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert np.all(np.isfinite(got)) and err <= tol, f"relative L2 error {err:.2e} > {tol:.0e}"


def ssu_inputs(seed, batch, dim, dstate, groups, dtype=F32, state_dtype=F32, slots=None):
    rng = np.random.default_rng(seed)
    return dict(
        state=rnd(rng, (slots or batch, dim, dstate), state_dtype),
        x=rnd(rng, (batch, dim), dtype),
        dt=rnd(rng, (batch, dim), dtype),
        A=-jnp.asarray(rng.uniform(0.05, 2.0, (dim, dstate)), F32),
        B=rnd(rng, (batch, groups, dstate), dtype),
        C=rnd(rng, (batch, groups, dstate), dtype),
        D=rnd(rng, (dim,)),
        z=rnd(rng, (batch, dim), dtype),
        dt_bias=rnd(rng, (dim,), scale=0.3),
    )


@pytest.mark.compat
@pytest.mark.parametrize("dtype,state_dtype,tol", [(F32, F32, 1e-5), (BF16, F32, 1e-2), (BF16, BF16, 2e-2)])
@pytest.mark.parametrize("shape", [(2, 64, 16, 1), (3, 40, 5, 4)])
def test_state_update_matches_reference(dtype, state_dtype, tol, shape):
    kw = ssu_inputs(0, *shape, dtype=dtype, state_dtype=state_dtype)
    out, state = jax.jit(xla_ssm.selective_state_update, static_argnames="dt_softplus")(**kw, dt_softplus=True)
    want_out, want_state = xla_ssm.selective_state_update_ref(**kw, dt_softplus=True)
    close(out, want_out, tol)
    close(state, want_state, tol)


def test_state_update_pool_indices():
    kw = ssu_inputs(1, 4, 32, 16, 2, slots=7)
    ix = jnp.asarray([5, -1, 0, 2], jnp.int32)
    out, state = xla_ssm.selective_state_update(**kw, dt_softplus=True, state_batch_indices=ix)
    want_out, want_state = xla_ssm.selective_state_update_ref(**kw, dt_softplus=True, state_batch_indices=ix)
    close(out, want_out, 1e-5)
    close(state, want_state, 1e-5)
    assert np.all(np.asarray(out)[1] == 0)
    untouched = [1, 3, 4, 6]
    np.testing.assert_array_equal(np.asarray(state)[untouched], np.asarray(kw["state"])[untouched])


@pytest.mark.compat
def test_donated_state_is_updated_in_place():
    kw = ssu_inputs(2, 2, 32, 16, 1)
    step = jax.jit(xla_ssm.selective_state_update, donate_argnums=0)
    state = kw.pop("state")
    want = xla_ssm.selective_state_update_ref(state, **kw)[1]
    pointer = state.unsafe_buffer_pointer() if hasattr(state, "unsafe_buffer_pointer") else None
    _, new = step(state, **kw)
    close(new, want, 1e-5)
    if pointer is not None and jax.default_backend() != "cpu":
        assert new.unsafe_buffer_pointer() == pointer


@pytest.mark.parametrize("dtype,tol", [(F32, 2e-5), (BF16, 2e-2)])
def test_64_token_decode_matches_full_scan(dtype, tol):
    rng = np.random.default_rng(3)
    batch, dim, dstate, seqlen, groups = 2, 48, 16, 64, 2
    u = rnd(rng, (batch, dim, seqlen), dtype)
    delta = rnd(rng, (batch, dim, seqlen), dtype, 0.5)
    z = rnd(rng, (batch, dim, seqlen), dtype)
    A = -jnp.asarray(rng.uniform(0.05, 2.0, (dim, dstate)), F32)
    B = rnd(rng, (batch, groups, dstate, seqlen), dtype)
    C = rnd(rng, (batch, groups, dstate, seqlen), dtype)
    D, bias = rnd(rng, (dim,)), rnd(rng, (dim,), scale=0.3)
    out_full, final = xla_ssm.selective_scan_fwd(u, delta, A, B, C, D, z, bias, delta_softplus=True)

    @jax.jit
    def decode(state):
        def step(state, t):
            x_t, dt_t, z_t = u[..., t], delta[..., t], z[..., t]
            y, state = xla_ssm.selective_state_update(
                state, x_t, dt_t, A, B[..., t], C[..., t], D, z_t, bias, dt_softplus=True
            )
            return state, y

        state, ys = jax.lax.scan(step, state, jnp.arange(seqlen))
        return jnp.moveaxis(ys, 0, -1), state

    out, state = decode(jnp.zeros((batch, dim, dstate), F32))
    close(out, out_full, tol)
    close(state, final, 1e-5)


@pytest.mark.compat
@pytest.mark.parametrize("layout", ["bdl", "bld"])
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("bias,init,act", [(True, True, "silu"), (False, False, None)])
def test_causal_conv1d_and_grad(layout, width, bias, init, act):
    rng = np.random.default_rng(width)
    batch, dim, seqlen = 2, 24, 33
    shape = (batch, dim, seqlen) if layout == "bdl" else (batch, seqlen, dim)
    x, w = rnd(rng, shape), rnd(rng, (dim, width), scale=0.5)
    b = rnd(rng, (dim,)) if bias else None
    h0 = rnd(rng, (batch, dim, width - 1)) if init else None
    out = xla_ssm.causal_conv1d(x, w, b, h0, activation=act, layout=layout)
    close(out, xla_ssm.causal_conv1d_ref(x, w, b, h0, activation=act, layout=layout), 1e-5)
    cot = rnd(rng, shape)

    def loss(f):
        return lambda *a: jnp.sum(f(*a, activation=act, layout=layout) * cot)

    argnums = tuple(i for i, v in enumerate((x, w, b, h0)) if v is not None)
    got = jax.grad(loss(xla_ssm.causal_conv1d), argnums)(x, w, b, h0)
    want = jax.grad(loss(xla_ssm.causal_conv1d_ref), argnums)(x, w, b, h0)
    for g, v in zip(got, want):
        close(g, v, 1e-5)


def conv_boundaries(rng, total):
    """Random lengths adding up to `total`, with empty, length-1 and length-2 sequences among them."""
    lens = [0, 1, 2]
    left = total - 3
    while left:
        length = min(left, int(rng.choice([0, 1, 2, rng.integers(3, 30)])))
        lens.append(length)
        left -= length
    rng.shuffle(lens)
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def conv_problem(seed, layout="bdl", width=4, dtype=F32, bias=True, init=True, dim=10, total=70):
    rng = np.random.default_rng(seed)
    cu = conv_boundaries(rng, total)
    shape = (1, dim, total) if layout == "bdl" else (1, total, dim)
    return dict(
        x=rnd(rng, shape, dtype),
        weight=rnd(rng, (dim, width), dtype, 0.5),
        bias=rnd(rng, (dim,), dtype) if bias else None,
        initial_states=rnd(rng, (len(cu) - 1, dim, width - 1), dtype) if init else None,
    ), cu


# Every width, layout and dtype / bias / initial state / activation combination, each at least once
# (the CUDA and CPU kernels' full matrix is tests/suite/conv1d_packed.rs).
@pytest.mark.parametrize("layout,width,dtype,bias,init,act", [
    ("bdl", 2, F32, True, True, "silu"), ("bld", 3, F32, False, False, None), ("bdl", 4, BF16, True, False, "silu"),
    ("bld", 2, BF16, False, True, None), ("bld", 4, F32, True, True, "silu"), ("bdl", 3, BF16, False, True, None),
])  # fmt: skip
def test_causal_conv1d_packed_matches_per_sequence(layout, width, dtype, bias, init, act):
    args, cu = conv_problem(width + 10 * bias, layout, width, dtype, bias, init)
    tol = 1e-5 if dtype == F32 else 2e-2
    kw = dict(activation=act, layout=layout, return_final_states=True, cu_seqlens=cu)
    out, last = jax.jit(lambda a, c: xla_ssm.causal_conv1d(**a, **{**kw, "cu_seqlens": c}))(args, cu)
    want_out, want_last = jax.jit(lambda a: xla_ssm.causal_conv1d_ref(**a, **kw))(args)
    close(out, want_out, tol)
    assert last.shape == (len(cu) - 1, 10, width - 1) and last.dtype == dtype
    np.testing.assert_array_equal(np.asarray(last, np.float32), np.asarray(want_last, np.float32))

    cot = jnp.asarray(np.random.default_rng(0).standard_normal(out.shape), F32)

    def loss(fn):
        def f(a):
            o, fin = fn(**a, **kw)
            return jnp.sum(o.astype(F32) * cot) + jnp.sum(jnp.sin(fin.astype(F32)))

        return f

    diff = {k: v for k, v in args.items() if v is not None}
    got = jax.jit(jax.grad(loss(xla_ssm.causal_conv1d)))(diff)
    want = jax.jit(jax.grad(loss(xla_ssm.causal_conv1d_ref)))(diff)
    for name in diff:
        close(got[name], want[name], 3 * tol)


def test_causal_conv1d_packed_equals_separate_calls():
    """Each packed sequence's out and final state are what a call on that sequence alone gives, and
    the final states continue with causal_conv1d_update."""
    args, cu = conv_problem(20, "bld", 4, F32)
    out, last = xla_ssm.causal_conv1d(**args, activation="silu", layout="bld", return_final_states=True, cu_seqlens=cu)
    nxt = jnp.asarray(np.random.default_rng(1).standard_normal((len(cu) - 1, 10)), F32)
    for s in range(len(cu) - 1):
        part = args["x"][:, cu[s] : cu[s + 1]]
        h0 = args["initial_states"][s : s + 1]
        o, fin = xla_ssm.causal_conv1d(
            part, args["weight"], args["bias"], h0, activation="silu", layout="bld", return_final_states=True
        )
        close(out[:, cu[s] : cu[s + 1]], o, 1e-6)
        np.testing.assert_array_equal(np.asarray(last[s : s + 1]), np.asarray(fin))
        y, _ = xla_ssm.causal_conv1d_update(nxt[s : s + 1], last[s : s + 1], args["weight"], args["bias"], "silu")
        full = jnp.concatenate([part, nxt[s : s + 1, None, :]], axis=1)
        want = xla_ssm.causal_conv1d_ref(full, args["weight"], args["bias"], h0, "silu", "bld")[:, -1]
        close(y, want, 1e-5)


def test_causal_conv1d_packed_traced_boundaries_and_the_cpu_check():
    args, cu = conv_problem(21)
    run = jax.jit(lambda a, c: xla_ssm.causal_conv1d(**a, activation="silu", cu_seqlens=c, return_final_states=True))
    out, last = run(args, jnp.asarray(cu))
    want_out, want_last = xla_ssm.causal_conv1d_ref(**args, activation="silu", cu_seqlens=cu, return_final_states=True)
    close(out, want_out, 1e-5)
    close(last, want_last, 0)
    bad = cu.copy()
    bad[3], bad[4] = bad[4] + 1, bad[3]  # decreasing, and not checked in Python: traced
    if jax.default_backend() == "cpu":
        with pytest.raises(Exception, match="cu_seqlens"):
            jax.block_until_ready(run(args, jnp.asarray(bad)))


def test_causal_conv1d_packed_empty():
    w = jnp.ones((6, 3), F32)
    for cu, h0 in (([0], None), ([0, 0, 0], jnp.ones((2, 6, 2), F32))):
        x = jnp.zeros((1, 6, 0), F32)
        out, last = xla_ssm.causal_conv1d(x, w, initial_states=h0, return_final_states=True, cu_seqlens=cu)
        assert out.shape == (1, 6, 0) and last.shape == (len(cu) - 1, 6, 2)
        if h0 is not None:
            np.testing.assert_array_equal(np.asarray(last), np.asarray(h0))

            def final_sum(h, x=x, cu=cu):
                return xla_ssm.causal_conv1d(x, w, None, h, return_final_states=True, cu_seqlens=cu)[1].sum()

            g = jax.grad(final_sum)(h0)
            np.testing.assert_array_equal(np.asarray(g), np.ones_like(h0))


@pytest.mark.parametrize("same_boundaries", [True, False])
def test_causal_conv1d_packed_vmap(same_boundaries):
    a1, cu1 = conv_problem(22)
    cu2 = cu1
    if not same_boundaries:  # the same number of sequences, other boundaries
        cu2 = np.sort(np.random.default_rng(5).integers(0, 71, len(cu1))).astype(np.int32)
        cu2[0], cu2[-1] = 0, 70
    xs = jnp.stack([a1["x"], jnp.flip(a1["x"], -1)])
    h0s = jnp.stack([a1["initial_states"], -a1["initial_states"]])
    cus = jnp.stack([jnp.asarray(cu1), jnp.asarray(cu2)])

    def one(x, h0, cu):
        return xla_ssm.causal_conv1d(x, a1["weight"], a1["bias"], h0, "silu", return_final_states=True, cu_seqlens=cu)

    out, last = jax.jit(jax.vmap(one))(xs, h0s, cus)
    gx = jax.jit(jax.vmap(jax.grad(lambda x, h0, cu: jnp.sum(jnp.cos(one(x, h0, cu)[0])))))(xs, h0s, cus)
    for i, cu in enumerate((cu1, cu2)):
        kw = dict(activation="silu", return_final_states=True, cu_seqlens=cu)
        want_out, want_last = jax.jit(lambda x, h0: xla_ssm.causal_conv1d_ref(x, a1["weight"], a1["bias"], h0, **kw))(
            xs[i], h0s[i]
        )
        close(out[i], want_out, 1e-5)
        close(last[i], want_last, 0)

        def ref_loss(x, h0=h0s[i], cu=cu):
            return jnp.sum(jnp.cos(xla_ssm.causal_conv1d_ref(x, a1["weight"], a1["bias"], h0, "silu", cu_seqlens=cu)))

        want_g = jax.jit(jax.grad(ref_loss))(xs[i])
        close(gx[i], want_g, 1e-5)


@pytest.mark.parametrize("cu, match", [
    ([1, 5, 70], "start at 0"), ([0, 40, 30, 70], "never decrease"), ([0, 5, 69], "end at seqlen"),
    ([0, 5, 71], "end at seqlen"), ([0], "end at seqlen"),
])  # fmt: skip
def test_causal_conv1d_packed_bad_boundaries(cu, match):
    args, _ = conv_problem(24, init=False)
    with pytest.raises(ValueError, match=match):
        xla_ssm.causal_conv1d(**args, cu_seqlens=np.asarray(cu, np.int32))


def test_causal_conv1d_packed_shape_errors():
    args, cu = conv_problem(25)
    x2 = jnp.concatenate([args["x"], args["x"]])
    with pytest.raises(ValueError, match="batch row"):
        xla_ssm.causal_conv1d(x2, args["weight"], cu_seqlens=cu)
    with pytest.raises(ValueError, match="rank-1 integer"):
        xla_ssm.causal_conv1d(args["x"], args["weight"], cu_seqlens=cu.astype(np.float32))
    with pytest.raises(ValueError, match="rank-1 integer"):
        xla_ssm.causal_conv1d(args["x"], args["weight"], cu_seqlens=cu[None])
    with pytest.raises(ValueError, match=r"initial_states \(num_seqs rows"):
        xla_ssm.causal_conv1d(args["x"], args["weight"], initial_states=args["initial_states"][1:], cu_seqlens=cu)


@pytest.mark.parametrize("dtype,tol", [(F32, 1e-5), (BF16, 1e-2)])
def test_conv_update_continues_the_forward_conv(dtype, tol):
    rng = np.random.default_rng(4)
    batch, dim, seqlen, width = 3, 16, 12, 4
    x, w, b = rnd(rng, (batch, dim, seqlen), dtype), rnd(rng, (dim, width), dtype, 0.5), rnd(rng, (dim,), dtype)
    full = xla_ssm.causal_conv1d(x, w, b, activation="silu")
    prefix, state = xla_ssm.causal_conv1d(x[..., :5], w, b, activation="silu", return_final_states=True)
    outs = [prefix]
    for t in range(5, seqlen):
        y, state = xla_ssm.causal_conv1d_update(x[..., t], state, w, b, activation="silu")
        outs.append(y[..., None])
    close(jnp.concatenate(outs, -1), full, tol)
    np.testing.assert_array_equal(np.asarray(state, np.float32), np.asarray(x[..., -(width - 1) :], np.float32))


@pytest.mark.compat
def test_fused_decode_step_matches_the_composition():
    kw = ssu_inputs(5, 3, 64, 16, 2, dtype=BF16, slots=5)
    rng = np.random.default_rng(6)
    conv_state, w, cb = rnd(rng, (5, 64, 3), BF16), rnd(rng, (64, 4), F32, 0.5), rnd(rng, (64,))
    ix = jnp.asarray([4, 0, -1], jnp.int32)
    ssm = kw.pop("state")
    out, cs, ss = jax.jit(xla_ssm.mamba_decode_step, static_argnames="dt_softplus")(
        kw["x"], conv_state, w, ssm, kw["dt"], kw["A"], kw["B"], kw["C"], cb, kw["D"], kw["z"], kw["dt_bias"],
        dt_softplus=True, state_batch_indices=ix,
    )
    xc, want_cs = xla_ssm.causal_conv1d_update(kw["x"].astype(F32), conv_state.astype(F32), w, cb, "silu", ix)
    want_out, want_ss = xla_ssm.selective_state_update_ref(
        ssm, xc, kw["dt"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["dt_bias"], True, ix
    )
    close(out, want_out, 2e-2)
    close(ss, want_ss, 1e-4)
    np.testing.assert_array_equal(np.asarray(cs, np.float32), np.asarray(want_cs, np.float32))


def test_python_side_errors():
    kw = ssu_inputs(7, 2, 8, 4, 1)
    with pytest.raises(ValueError, match="dt must have shape"):
        xla_ssm.selective_state_update(**{**kw, "dt": kw["dt"][:, :3]})
    with pytest.raises(TypeError, match="state must be float32"):
        xla_ssm.selective_state_update(**{**kw, "state": kw["state"].astype(jnp.float16)})
    with pytest.raises(ValueError, match="width in 2..4"):
        xla_ssm.causal_conv1d(jnp.zeros((1, 8, 4)), jnp.zeros((8, 5)))
    with pytest.raises(ValueError, match="layout"):
        xla_ssm.causal_conv1d(jnp.zeros((1, 8, 4)), jnp.zeros((8, 3)), layout="lbd")
    with pytest.raises(TypeError, match="dt_softplus"):
        xla_ssm.selective_state_update(**kw, dt_softplus=1)
