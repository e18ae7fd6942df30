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
