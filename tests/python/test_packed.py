"""Packed sequences (`cu_seqlens`) in xla_ssm.selective_scan: against the reference that runs each
sequence on its own (forward, final states, every gradient), under jit with traced boundaries, vmap
of packed streams, and the errors for bad boundaries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xla_ssm

F32, BF16 = jnp.float32, jnp.bfloat16

def rnd(rng, shape, dtype=F32, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def close(got, want, tol, what=""):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert np.all(np.isfinite(got)) and err <= tol, f"{what}: relative L2 error {err:.2e} > {tol:.0e}"


def boundaries(rng, total):
    """Random lengths adding up to `total`, with empty and length-1 sequences among them."""
    lens = [0, 1]
    left = total - 1
    while left:
        length = min(left, int(rng.choice([0, 1, rng.integers(2, 90)])))
        lens.append(length)
        left -= length
    rng.shuffle(lens)
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def problem(seed, dim=12, dstate=8, total=160, layout="bdl", groups=2, dtype=F32, h0=True):
    rng = np.random.default_rng(seed)
    cu = boundaries(rng, total)
    x_shape = (1, dim, total) if layout == "bdl" else (1, total, dim)
    bc_shape = (1, groups, dstate, total) if layout == "bdl" else (1, total, groups, dstate)
    if groups == 0:
        bc_shape = (dim, dstate)
    args = dict(
        u=rnd(rng, x_shape, dtype),
        delta=rnd(rng, x_shape, dtype, 0.5),
        A=-jnp.exp(rnd(rng, (dim, dstate), F32, 0.5)),
        B=rnd(rng, bc_shape, dtype if groups else F32),
        C=rnd(rng, bc_shape, dtype if groups else F32),
        D=rnd(rng, (dim,)),
        z=rnd(rng, x_shape, dtype),
        delta_bias=rnd(rng, (dim,), F32, 0.3),
        initial_state=rnd(rng, (len(cu) - 1, dim, dstate)) if h0 else None,
    )
    return args, cu


@pytest.mark.parametrize("layout, groups, dtype, h0", [
    ("bdl", 2, F32, True), ("bld", 0, F32, False), ("bld", 3, BF16, True),
])  # fmt: skip
def test_forward_and_gradients_match_per_sequence(layout, groups, dtype, h0):
    args, cu = problem(1, layout=layout, groups=groups, dtype=dtype, h0=h0)
    tol = 1e-5 if dtype == F32 else 2e-2

    def loss(fn, **kw):
        def f(a):
            out, last = fn(**a, **kw)
            w = jnp.cos(jnp.arange(out.size, dtype=F32)).reshape(out.shape)
            return jnp.sum(out.astype(F32) * w) + jnp.sum(jnp.sin(last))

        return f

    ours = dict(delta_softplus=True, return_final_state=True, layout=layout)
    out, last = jax.jit(lambda a, c: xla_ssm.selective_scan(**a, **ours, cu_seqlens=c))(args, cu)
    want_out, want_last = xla_ssm.selective_scan_ref(**args, delta_softplus=True, layout=layout, cu_seqlens=cu)
    close(out, want_out, tol, "out")
    close(last, want_last, tol, "final_state")
    assert last.shape == (len(cu) - 1, *want_last.shape[1:])

    diff = {k: v for k, v in args.items() if v is not None}
    got = jax.jit(jax.grad(loss(xla_ssm.selective_scan, **ours, cu_seqlens=cu)))(diff)
    want = jax.jit(jax.grad(loss(xla_ssm.selective_scan_ref, delta_softplus=True, layout=layout, cu_seqlens=cu)))(diff)
    for name in diff:
        close(got[name], want[name], 3 * tol, f"d{name}")


def test_traced_boundaries_and_the_cpu_check():
    args, cu = problem(2)
    run = jax.jit(lambda a, c: xla_ssm.selective_scan(**a, delta_softplus=True, cu_seqlens=c, return_final_state=True))
    out, last = run(args, jnp.asarray(cu))
    want_out, want_last = xla_ssm.selective_scan_ref(**args, delta_softplus=True, cu_seqlens=cu)
    close(out, want_out, 1e-5, "out")
    close(last, want_last, 1e-5, "final_state")
    bad = cu.copy()
    bad[2], bad[3] = bad[3] + 1, bad[2]  # decreasing, and not checked in Python: traced
    if jax.default_backend() == "cpu":
        with pytest.raises(Exception, match="cu_seqlens"):
            jax.block_until_ready(run(args, jnp.asarray(bad)))


def test_vmap_of_packed_streams():
    a1, cu = problem(3)
    a2 = {k: None if v is None else jnp.flip(v, -1) for k, v in a1.items()}  # a second stream, same boundaries
    stacked = {k: None if a1[k] is None else jnp.stack([a1[k], a2[k]]) for k in a1 if k not in ("A", "D", "delta_bias")}
    shared = {k: a1[k] for k in ("A", "D", "delta_bias")}

    def one(x):
        return xla_ssm.selective_scan(**x, **shared, delta_softplus=True, cu_seqlens=cu, return_final_state=True)

    out, last = jax.vmap(one)(stacked)
    for i, a in enumerate((a1, {**a2, **shared})):
        want_out, want_last = xla_ssm.selective_scan_ref(**a, delta_softplus=True, cu_seqlens=cu)
        close(out[i], want_out, 1e-5, f"out[{i}]")
        close(last[i], want_last, 1e-5, f"final_state[{i}]")


@pytest.mark.parametrize("cu, match", [
    ([1, 5, 160], "start at 0"), ([0, 90, 80, 160], "never decrease"), ([0, 5, 159], "end at seqlen"),
])  # fmt: skip
def test_bad_boundaries(cu, match):
    args, _ = problem(5)
    with pytest.raises(ValueError, match=match):
        xla_ssm.selective_scan(**{**args, "initial_state": None}, cu_seqlens=np.asarray(cu, np.int32))


def test_packed_needs_batch_one():
    args, cu = problem(6)
    u2 = jnp.concatenate([args["u"], args["u"]])
    with pytest.raises(ValueError, match="batch row"):
        xla_ssm.selective_scan(u2, u2, args["A"], args["B"][:, :, :, :] * 0 + 1, args["C"], cu_seqlens=cu)
