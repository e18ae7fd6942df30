"""`selective_scan_fwd` (the XLA FFI target) and `selective_scan_ref` (pure JAX, lax.scan)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "xla_ssm_selective_scan_fwd"
LAYOUTS = ("bdl", "bld")
MAX_DSTATE = 256
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_F32 = jnp.dtype(jnp.float32)


def _name(dt) -> str:
    return jnp.dtype(dt).name


def _check(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, layout):
    """Validate operands against docs/selective_scan_fwd.md; returns (batch, dim, seqlen, dstate, groups)."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(delta_softplus, (bool, np.bool_)):
        raise TypeError(
            f"delta_softplus must be a Python bool (static under jit), got {type(delta_softplus).__name__}"
        )
    for name, x in (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")

    if u.ndim != 3:
        raise ValueError(f"u must have rank 3 ({_layout_str(layout)}), got shape {tuple(u.shape)}")
    if u.dtype not in _FLOATS:
        raise TypeError(f"u must be float32, bfloat16 or float16, got {_name(u.dtype)}")
    if layout == "bdl":
        batch, dim, seqlen = u.shape
    else:
        batch, seqlen, dim = u.shape
    T = u.dtype

    def like_u(name, x):
        if tuple(x.shape) != tuple(u.shape):
            raise ValueError(f"{name} must have the shape of u {tuple(u.shape)}, got {tuple(x.shape)}")
        if x.dtype != T:
            raise TypeError(f"{name} must have the dtype of u ({_name(T)}), got {_name(x.dtype)}")

    def f32(name, x, shape):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
        if x.dtype != _F32:
            raise TypeError(f"{name} must be float32, got {_name(x.dtype)}")

    like_u("delta", delta)
    if A.ndim != 2 or A.shape[0] != dim:
        raise ValueError(f"A must have shape (dim={dim}, dstate), got {tuple(A.shape)}")
    dstate = A.shape[1]
    if not 1 <= dstate <= MAX_DSTATE:
        raise ValueError(f"dstate (A.shape[1]) must be in [1, {MAX_DSTATE}], got {dstate}")
    f32("A", A, (dim, dstate))

    if tuple(C.shape) != tuple(B.shape) or C.dtype != B.dtype:
        raise ValueError(
            f"C must have the shape and dtype of B {tuple(B.shape)} {_name(B.dtype)}, "
            f"got {tuple(C.shape)} {_name(C.dtype)}"
        )
    if B.dtype not in (_F32, T):
        raise TypeError(f"B and C must be float32 or the dtype of u ({_name(T)}), got {_name(B.dtype)}")
    if B.ndim == 2:
        groups = 1
        if tuple(B.shape) != (dim, dstate):
            raise ValueError(
                f"time-invariant B (rank 2) must have shape (dim, dstate)={(dim, dstate)}, got {tuple(B.shape)}"
            )
    elif B.ndim == 4:
        groups = B.shape[2] if layout == "bld" else B.shape[1]
        if layout == "bdl":
            want, form = (batch, groups, dstate, seqlen), "(batch, groups, dstate, seqlen)"
        else:
            want, form = (batch, seqlen, groups, dstate), "(batch, seqlen, groups, dstate)"
        if tuple(B.shape) != want:
            raise ValueError(f"B must have shape {form}={want}, got {tuple(B.shape)}")
        if groups < 1 or dim % groups != 0:
            raise ValueError(f"dim ({dim}) must be a multiple of groups ({groups}), groups >= 1")
    else:
        raise ValueError(
            f"B must have rank 2 (dim, dstate) or rank 4 (time-varying), got shape {tuple(B.shape)}"
        )

    if D is not None:
        f32("D", D, (dim,))
    if z is not None:
        like_u("z", z)
    if delta_bias is not None:
        f32("delta_bias", delta_bias, (dim,))
    if initial_state is not None:
        f32("initial_state", initial_state, (batch, dim, dstate))
    return batch, dim, seqlen, dstate, groups


def _layout_str(layout):
    return "(batch, dim, seqlen)" if layout == "bdl" else "(batch, seqlen, dim)"


def _as_arrays(*xs):
    return [None if x is None else jnp.asarray(x) if not hasattr(x, "dtype") else x for x in xs]


def selective_scan_fwd(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    layout="bdl",
):
    """Mamba-1 selective scan through the `xla_ssm_selective_scan_fwd` FFI target: `selective_scan`
    with return_final_state=True (so also differentiable, vmappable and shardable).

    Shapes and dtypes are those of docs/selective_scan_fwd.md; `delta_softplus` and `layout`
    are static (Python values). Returns `(out, final_state)`: out like u, final_state
    (batch, dim, dstate) float32.
    """
    from ._scan import selective_scan

    return selective_scan(
        u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
        initial_state=initial_state, return_final_state=True, layout=layout,
    )  # fmt: skip


def _softplus(x):
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def selective_scan_ref(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    layout="bdl",
    cu_seqlens=None,
):
    """Pure-JAX reference (`jax.lax.scan` over seqlen), same signature and results as
    `selective_scan_fwd`. Arithmetic in float32 (float64 if every input is float64 and x64 is on);
    `out` is cast to u's dtype. With `cu_seqlens` (concrete values) it runs each packed sequence on
    its own and puts the results together: out like u, final states (num_seqs, dim, dstate)."""
    if cu_seqlens is not None:
        return _packed_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, layout, cu_seqlens)
    u, delta, A, B, C, D, z, delta_bias, initial_state = _as_arrays(
        u, delta, A, B, C, D, z, delta_bias, initial_state
    )
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    acc = jnp.promote_types(jnp.float32, jnp.result_type(u, delta, A, B, C))

    def f(x):
        return None if x is None else x.astype(acc)

    out_dtype = u.dtype
    u, delta, A, B, C, D, z, delta_bias, h0 = map(
        f, (u, delta, A, B, C, D, z, delta_bias, initial_state)
    )
    if layout == "bld":  # to (batch, dim, seqlen); rank-4 B/C to (batch, groups, dstate, seqlen)
        u, delta = u.transpose(0, 2, 1), delta.transpose(0, 2, 1)
        z = None if z is None else z.transpose(0, 2, 1)
        if B.ndim == 4:
            B, C = B.transpose(0, 2, 3, 1), C.transpose(0, 2, 3, 1)
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]

    dt = delta if delta_bias is None else delta + delta_bias[None, :, None]
    if delta_softplus:
        dt = _softplus(dt)
    h = jnp.zeros((batch, dim, dstate), acc) if h0 is None else h0

    time_varying = B.ndim == 4
    groups = B.shape[1] if time_varying else 1
    per = dim // groups if groups else 0

    def step(h, xs):
        dt_l, u_l, B_l, C_l = xs  # (batch, dim), (batch, dim), (batch, groups, dstate) or None
        dA = jnp.exp(dt_l[..., None] * A)  # (batch, dim, dstate)
        if time_varying:
            hg = h.reshape(batch, groups, per, dstate)
            dAg = dA.reshape(batch, groups, per, dstate)
            dBu = (dt_l * u_l).reshape(batch, groups, per)[..., None] * B_l[:, :, None, :]
            hg = dAg * hg + dBu
            y = jnp.sum(hg * C_l[:, :, None, :], axis=-1).reshape(batch, dim)
            h = hg.reshape(batch, dim, dstate)
        else:
            h = dA * h + (dt_l * u_l)[..., None] * B
            y = jnp.sum(h * C, axis=-1)
        return h, y

    xs = (
        jnp.moveaxis(dt, -1, 0),
        jnp.moveaxis(u, -1, 0),
        jnp.moveaxis(B, -1, 0) if time_varying else None,
        jnp.moveaxis(C, -1, 0) if time_varying else None,
    )
    h, ys = jax.lax.scan(step, h, xs, length=seqlen)
    y = jnp.moveaxis(ys, 0, -1)  # (batch, dim, seqlen)
    if D is not None:
        y = y + D[None, :, None] * u
    if z is not None:
        y = y * (z * jax.nn.sigmoid(z))
    if layout == "bld":
        y = y.transpose(0, 2, 1)
    return y.astype(out_dtype), h


def _packed_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, layout, cu_seqlens):
    """selective_scan_ref of each sequence packed in a batch-1 input, concatenated."""
    cu = [int(c) for c in np.asarray(cu_seqlens)]
    axis = 2 if layout == "bdl" else 1  # seqlen of u, delta, z
    bc_axis = 3 if layout == "bdl" else 1  # seqlen of time-varying B, C
    outs, finals = [], []
    for s in range(len(cu) - 1):
        piece = slice(cu[s], cu[s + 1])

        def cut(x, ax):
            return None if x is None else jax.lax.slice_in_dim(x, piece.start, piece.stop, axis=ax)

        bc = (cut(B, bc_axis), cut(C, bc_axis)) if B.ndim == 4 else (B, C)
        h0 = None if initial_state is None else initial_state[s : s + 1]
        out, h = selective_scan_ref(
            cut(u, axis), cut(delta, axis), A, *bc, D, cut(z, axis), delta_bias, delta_softplus, h0, layout
        )
        outs.append(out)
        finals.append(h)
    return jnp.concatenate(outs, axis=axis), jnp.concatenate(finals, axis=0)
