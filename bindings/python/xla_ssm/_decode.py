"""Decode-time targets: `selective_state_update`, `causal_conv1d` (with its VJP),
`causal_conv1d_update` and the fused `mamba_decode_step`, plus pure-jnp references.

States are updated in place: each state operand is aliased to its result
(`input_output_aliases`), so under `jax.jit` a caller that donates the state
(`jax.jit(step, donate_argnums=...)`) or threads it through a `lax.scan`/`fori_loop` carry
gets no copy at all. Without donation XLA copies the state before the call (correct, slower).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _lib

_F32 = jnp.dtype(jnp.float32)
_FLOATS = (_F32, jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_S32 = jnp.dtype(jnp.int32)
LAYOUTS = ("bdl", "bld")
MAX_DSTATE = 256


def _arr(name, x):
    if x is None:
        return None
    if not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    return x


def _need(name, x, shape, dtypes):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if jnp.dtype(x.dtype) not in dtypes:
        names = " or ".join(jnp.dtype(d).name for d in dtypes)
        raise TypeError(f"{name} must be {names}, got {jnp.dtype(x.dtype).name}")


def _f32_or(T):
    return (_F32,) if T == _F32 else (_F32, T)


def _flag(name, v):
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python bool (static under jit), got {type(v).__name__}")
    return np.bool_(v)


def _check_update(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices):
    if x.ndim != 2 or jnp.dtype(x.dtype) not in _FLOATS:
        raise ValueError(f"x must be a (batch, dim) float32/bfloat16/float16 array, got {tuple(x.shape)} {x.dtype}")
    T = jnp.dtype(x.dtype)
    batch, dim = x.shape
    _need("dt", dt, (batch, dim), (T,))
    if A.ndim != 2 or A.shape[0] != dim:
        raise ValueError(f"A must have shape (dim={dim}, dstate), got {tuple(A.shape)}")
    dstate = A.shape[1]
    if dstate > MAX_DSTATE:
        raise ValueError(f"dstate (A.shape[1]) must be at most {MAX_DSTATE}, got {dstate}")
    _need("A", A, (dim, dstate), (_F32,))
    if B.ndim != 3 or B.shape[0] != batch or B.shape[2] != dstate:
        raise ValueError(f"B must have shape (batch={batch}, groups, dstate={dstate}), got {tuple(B.shape)}")
    groups = B.shape[1]
    if groups < 1 or dim % groups:
        raise ValueError(f"groups (B.shape[1] = {groups}) must divide dim ({dim})")
    _need("B", B, B.shape, _f32_or(T))
    _need("C", C, B.shape, (jnp.dtype(B.dtype),))
    for name, v in (("D", D), ("dt_bias", dt_bias)):
        if v is not None:
            _need(name, v, (dim,), (_F32,))
    if z is not None:
        _need("z", z, (batch, dim), (T,))
    if state_batch_indices is not None:
        _need("state_batch_indices", state_batch_indices, (batch,), (_S32,))
        if state.ndim != 3:
            raise ValueError(f"state must have rank 3 (slots, dim, dstate), got {tuple(state.shape)}")
        slots = state.shape[0]
    else:
        slots = batch
    _need("state", state, (slots, dim, dstate), _f32_or(T))
    return T, batch, dim, dstate


def _ffi(target, results, operands, aliases, **attrs):
    _lib.load()
    call = jax.ffi.ffi_call(
        target, tuple(results), vmap_method="sequential", input_output_aliases=aliases
    )
    return call(*operands, **attrs)


def selective_state_update(
    state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, state_batch_indices=None
):
    """One decode token of the Mamba-1 selective scan (target `xla_ssm_selective_state_update`).

    state (batch, dim, dstate) float32 or x's dtype -- or (slots, dim, dstate) with
    `state_batch_indices` (batch,) int32: row i updates state[state_batch_indices[i]]; negative
    entries are padding (output 0, no state touched). x, dt, z: (batch, dim); A (dim, dstate) f32;
    B, C (batch, groups, dstate) float32 or x's dtype; D, dt_bias (dim,) f32.
    Returns (out (batch, dim), new_state). The state is aliased to new_state: donate it under jit.
    """
    state, x, dt, A, B, C, D, z, dt_bias, ix = (
        _arr(n, v)
        for n, v in zip(
            "state x dt A B C D z dt_bias ix".split(),
            (state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices),
        )
    )
    T, batch, dim, _ = _check_update(state, x, dt, A, B, C, D, z, dt_bias, ix)
    optional = [v for v in (D, z, dt_bias, ix) if v is not None]
    return _ffi(
        "xla_ssm_selective_state_update",
        [jax.ShapeDtypeStruct((batch, dim), T), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        [state, x, dt, A, B, C, *optional],
        {0: 1},
        dt_softplus=_flag("dt_softplus", dt_softplus),
        has_d=np.bool_(D is not None),
        has_z=np.bool_(z is not None),
        has_dt_bias=np.bool_(dt_bias is not None),
        has_state_batch_indices=np.bool_(ix is not None),
    )


def _softplus(x):
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def selective_state_update_ref(
    state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, state_batch_indices=None
):
    """Pure-jnp reference of `selective_state_update` (f32 arithmetic; returns new arrays)."""
    T = x.dtype
    batch, dim = x.shape
    groups, dstate = B.shape[1], B.shape[2]
    f = lambda v: None if v is None else jnp.asarray(v).astype(jnp.float32)  # noqa: E731
    xf, dtf, Bf, Cf = f(x), f(dt), f(B), f(C)
    if dt_bias is not None:
        dtf = dtf + dt_bias
    if dt_softplus:
        dtf = _softplus(dtf)
    Bg = jnp.repeat(Bf, dim // groups, axis=1)  # (batch, dim, dstate)
    Cg = jnp.repeat(Cf, dim // groups, axis=1)
    rows = state if state_batch_indices is None else state[jnp.maximum(state_batch_indices, 0)]
    h = jnp.exp(dtf[..., None] * A) * rows.astype(jnp.float32) + (dtf * xf)[..., None] * Bg
    h = h.astype(state.dtype)
    y = jnp.sum(h.astype(jnp.float32) * Cg, axis=-1)
    if D is not None:
        y = y + D * xf
    if z is not None:
        y = y * jax.nn.silu(f(z))
    if state_batch_indices is None:
        return y.astype(T), h
    valid = state_batch_indices >= 0
    y = jnp.where(valid[:, None], y, 0.0)
    target = jnp.where(valid, state_batch_indices, state.shape[0])  # padding rows: dropped
    return y.astype(T), state.at[target].set(h, mode="drop")


# ------------------------------------------------------------------------------------ conv1d
def _check_conv(x, weight, bias, layout, ranks=(3,)):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if x.ndim not in ranks or jnp.dtype(x.dtype) not in _FLOATS:
        raise ValueError(
            f"x must be a rank-{' or '.join(map(str, ranks))} float32/bfloat16/float16 array, "
            f"got {tuple(x.shape)} {x.dtype}"
        )
    if x.ndim == 2:
        batch, dim, seqlen = x.shape[0], x.shape[1], 1
    elif layout == "bdl":
        batch, dim, seqlen = x.shape
    else:
        batch, seqlen, dim = x.shape
    T = jnp.dtype(x.dtype)
    if weight.ndim != 2 or weight.shape[0] != dim or not 2 <= weight.shape[1] <= 4:
        raise ValueError(f"weight must have shape (dim={dim}, width) with width in 2..4, got {tuple(weight.shape)}")
    _need("weight", weight, weight.shape, _f32_or(T))
    if bias is not None:
        _need("bias", bias, (dim,), (jnp.dtype(weight.dtype),))
    return T, batch, dim, seqlen, weight.shape[1]


def _activation(activation):
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    return activation is not None


def _packed_attr(cu_seqlens):
    # Left out when unpacked: the attribute is optional (absent: false).
    return {"has_cu_seqlens": np.bool_(True)} if cu_seqlens is not None else {}


def _conv_fwd_call(x, weight, bias, initial_states, cu_seqlens, silu, layout):
    optional = [v for v in (bias, initial_states, cu_seqlens) if v is not None]
    (out,) = _ffi(
        "xla_ssm_causal_conv1d_fwd",
        [jax.ShapeDtypeStruct(x.shape, x.dtype)],
        [x, weight, *optional],
        {},
        silu=np.bool_(silu),
        layout=layout,
        has_bias=np.bool_(bias is not None),
        has_initial_states=np.bool_(initial_states is not None),
        **_packed_attr(cu_seqlens),
    )
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _conv(x, weight, bias, initial_states, cu_seqlens, silu, layout):
    return _conv_fwd_call(x, weight, bias, initial_states, cu_seqlens, silu, layout)


def _conv_vjp_fwd(x, weight, bias, initial_states, cu_seqlens, silu, layout):
    out = _conv_fwd_call(x, weight, bias, initial_states, cu_seqlens, silu, layout)
    return out, (x, weight, bias, initial_states, cu_seqlens)


def _conv_vjp_bwd(silu, layout, res, dout):
    x, weight, bias, initial_states, cu_seqlens = res
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(weight.shape, weight.dtype)]
    if bias is not None:
        results.append(jax.ShapeDtypeStruct(bias.shape, bias.dtype))
    if initial_states is not None:
        results.append(jax.ShapeDtypeStruct(initial_states.shape, initial_states.dtype))
    optional = [v for v in (bias, initial_states, cu_seqlens) if v is not None]
    grads = list(
        _ffi(
            "xla_ssm_causal_conv1d_bwd",
            results,
            [x, weight, dout.astype(x.dtype), *optional],
            {},
            silu=np.bool_(silu),
            layout=layout,
            has_bias=np.bool_(bias is not None),
            has_initial_states=np.bool_(initial_states is not None),
            **_packed_attr(cu_seqlens),
        )
    )
    dx, dw = grads[0], grads[1]
    rest = grads[2:]
    db = rest.pop(0) if bias is not None else None
    dh0 = rest.pop(0) if initial_states is not None else None
    dcu = None if cu_seqlens is None else np.zeros(cu_seqlens.shape, jax.dtypes.float0)
    return dx, dw, db, dh0, dcu


_conv.defvjp(_conv_vjp_fwd, _conv_vjp_bwd)


def _check_conv_cu_seqlens(cu_seqlens, batch, seqlen):
    """cu_seqlens as an int32 array, checked against x (batch 1); its values too when they are
    concrete (not traced)."""
    if not hasattr(cu_seqlens, "shape"):
        cu_seqlens = np.asarray(cu_seqlens)
    if batch != 1:
        raise ValueError(f"cu_seqlens packs sequences along seqlen of one batch row: x's batch must be 1, got {batch}")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1 or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise ValueError(
            "cu_seqlens must be a rank-1 integer array (num_seqs + 1,), "
            f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    if not isinstance(cu_seqlens, jax.core.Tracer):
        v = np.asarray(cu_seqlens)
        if v[0] != 0 or v[-1] != seqlen or np.any(np.diff(v) < 0):
            raise ValueError(
                f"cu_seqlens must start at 0, never decrease and end at seqlen (= {seqlen}), got {v.tolist()}"
            )
    return jnp.asarray(cu_seqlens, jnp.int32)


def _packed_final_states(xs, h0, cu, width):
    """Per sequence, the last width - 1 inputs of [h0[s] (or 0), xs[0, :, cu[s]:cu[s + 1]]]: (num_seqs,
    dim, width - 1). xs (1, dim, seqlen); h0 (num_seqs, dim, width - 1) or None; cu traced or not."""
    seqlen = xs.shape[-1]
    start, end = cu[:-1, None], cu[1:, None]
    pos = end - (width - 1) + jnp.arange(width - 1, dtype=cu.dtype)  # (num_seqs, width - 1)
    from_x = (pos >= start)[:, None, :]
    if seqlen:
        xv = jnp.moveaxis(xs[0][:, jnp.clip(pos, 0, seqlen - 1)], 0, 1)  # (num_seqs, dim, width - 1)
    else:
        xv = jnp.zeros((cu.shape[0] - 1, xs.shape[1], width - 1), xs.dtype)
    if h0 is None:
        hv = jnp.zeros_like(xv)
    else:
        j = jnp.clip(pos - start + (width - 1), 0, width - 2)
        hv = jnp.take_along_axis(h0, jnp.broadcast_to(j[:, None, :], h0.shape), axis=2)
    return jnp.where(from_x, xv, hv)


def causal_conv1d(
    x,
    weight,
    bias=None,
    initial_states=None,
    activation=None,
    layout="bdl",
    return_final_states=False,
    cu_seqlens=None,
):
    """Depthwise causal conv1d (targets `xla_ssm_causal_conv1d_fwd` / `_bwd`, differentiable).

    x (batch, dim, seqlen) ("bdl") or (batch, seqlen, dim) ("bld"); weight (dim, width), width 2..4,
    float32 or x's dtype; bias (dim,) of weight's dtype; initial_states (batch, dim, width - 1) of
    x's dtype (the inputs before x, oldest first); activation None or "silu". Returns out like x, and
    with `return_final_states` also the conv state after x, (batch, dim, width - 1), for
    `causal_conv1d_update`.

    cu_seqlens: int32 (num_seqs + 1,), sequences packed along seqlen of a batch-1 x: boundaries
    0 = cu[0] <= cu[1] <= ... <= cu[-1] = seqlen. The window restarts at each boundary: a sequence's
    outputs see only its inputs, with initial_states[s] ((num_seqs, dim, width - 1)) or zeros before
    its start; gradients do not cross boundaries. The final states are then per sequence,
    (num_seqs, dim, width - 1): each sequence's last width - 1 inputs, its initial state (or zeros)
    in front where it is shorter. Concrete boundaries are checked here; traced ones by the CPU
    target, while on CUDA invalid ones give undefined (but memory-safe) results. Under jax.vmap the
    calls run one example at a time.
    """
    x, weight, bias, initial_states = (_arr(n, v) for n, v in zip("x w b h0".split(), (x, weight, bias, initial_states)))
    T, batch, dim, seqlen, width = _check_conv(x, weight, bias, layout)
    rows = batch
    if cu_seqlens is not None:
        cu_seqlens = _check_conv_cu_seqlens(cu_seqlens, batch, seqlen)
        rows = cu_seqlens.shape[0] - 1
    if initial_states is not None:
        what = "initial_states" + (" (num_seqs rows with cu_seqlens)" if cu_seqlens is not None else "")
        _need(what, initial_states, (rows, dim, width - 1), (T,))
    out = _conv(x, weight, bias, initial_states, cu_seqlens, _activation(activation), layout)
    if not return_final_states:
        return out
    xs = x if layout == "bdl" else jnp.swapaxes(x, 1, 2)
    if cu_seqlens is not None:
        return out, _packed_final_states(xs, initial_states, cu_seqlens, width)
    h0 = jnp.zeros((batch, dim, width - 1), T) if initial_states is None else initial_states
    return out, jnp.concatenate([h0, xs], axis=-1)[..., seqlen:]


def causal_conv1d_ref(
    x, weight, bias=None, initial_states=None, activation=None, layout="bdl", return_final_states=False, cu_seqlens=None
):
    """Pure-jnp reference of `causal_conv1d` (f32 arithmetic, out in x's dtype). With `cu_seqlens`
    (concrete values) it runs each packed sequence on its own and puts the results together."""
    if cu_seqlens is not None:
        return _packed_conv_ref(x, weight, bias, initial_states, activation, layout, return_final_states, cu_seqlens)
    xs = x if layout == "bdl" else jnp.swapaxes(x, 1, 2)
    batch, dim, seqlen = xs.shape
    width = weight.shape[1]
    h0 = jnp.zeros((batch, dim, width - 1), jnp.float32) if initial_states is None else initial_states.astype(jnp.float32)
    xp = jnp.concatenate([h0, xs.astype(jnp.float32)], axis=-1)
    w = weight.astype(jnp.float32)
    out = sum(w[None, :, k, None] * xp[..., k : k + seqlen] for k in range(width))
    if bias is not None:
        out = out + bias.astype(jnp.float32)[None, :, None]
    if activation is not None:
        out = jax.nn.silu(out)
    out = out.astype(x.dtype)
    out = out if layout == "bdl" else jnp.swapaxes(out, 1, 2)
    if return_final_states:
        return out, xp[..., seqlen:].astype(x.dtype)
    return out


def _packed_conv_ref(x, weight, bias, initial_states, activation, layout, return_final_states, cu_seqlens):
    cu = [int(c) for c in np.asarray(cu_seqlens)]
    axis = 2 if layout == "bdl" else 1
    outs, finals = [], []
    for s in range(len(cu) - 1):
        part = jax.lax.slice_in_dim(x, cu[s], cu[s + 1], axis=axis)
        h0 = None if initial_states is None else initial_states[s : s + 1]
        out, last = causal_conv1d_ref(part, weight, bias, h0, activation, layout, return_final_states=True)
        outs.append(out)
        finals.append(last)
    out = jnp.concatenate(outs, axis=axis) if outs else x
    if not return_final_states:
        return out
    width = weight.shape[1]
    dim = x.shape[1] if layout == "bdl" else x.shape[2]
    last = jnp.concatenate(finals) if finals else jnp.zeros((0, dim, width - 1), x.dtype)
    return out, last


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, state_batch_indices=None, layout="bdl"):
    """Causal conv1d over new tokens from a conv state (target `xla_ssm_causal_conv1d_update`).

    x (batch, dim) for one token, or rank 3 in `layout`; conv_state (batch, dim, width - 1) of x's
    dtype -- or (slots, dim, width - 1) with `state_batch_indices` as in `selective_state_update`.
    Returns (out like x, new_conv_state); the state is aliased: donate it under jit.
    """
    x, conv_state, weight, bias, ix = (
        _arr(n, v) for n, v in zip("x cs w b ix".split(), (x, conv_state, weight, bias, state_batch_indices))
    )
    T, batch, dim, _, width = _check_conv(x, weight, bias, layout, ranks=(2, 3))
    slots = batch
    if ix is not None:
        _need("state_batch_indices", ix, (batch,), (_S32,))
        slots = conv_state.shape[0] if conv_state.ndim == 3 else -1
    _need("conv_state", conv_state, (slots, dim, width - 1), (T,))
    optional = [v for v in (bias, ix) if v is not None]
    return _ffi(
        "xla_ssm_causal_conv1d_update",
        [jax.ShapeDtypeStruct(x.shape, T), jax.ShapeDtypeStruct(conv_state.shape, T)],
        [x, conv_state, weight, *optional],
        {1: 1},
        silu=np.bool_(_activation(activation)),
        layout=layout,
        has_bias=np.bool_(bias is not None),
        has_state_batch_indices=np.bool_(ix is not None),
    )


def mamba_decode_step(
    x,
    conv_state,
    conv_weight,
    ssm_state,
    dt,
    A,
    B,
    C,
    conv_bias=None,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    state_batch_indices=None,
):
    """One token through a Mamba layer's SSM part in one kernel (target `xla_ssm_mamba_decode_step`):
    xc = silu(causal_conv1d_update(x, conv_state, conv_weight, conv_bias)), then
    selective_state_update(ssm_state, xc, dt, A, B, C, D, z, dt_bias, dt_softplus).

    dt, B, C are inputs, so this fits layers where they do not depend on xc (in Mamba-1 they are
    x_proj(xc): there use causal_conv1d_update and selective_state_update around the matmul).
    Returns (out, new_conv_state, new_ssm_state); both states are aliased: donate them under jit.
    """
    x, conv_state, conv_weight, ssm_state, dt, A, B, C, conv_bias, D, z, dt_bias, ix = (
        _arr(str(i), v)
        for i, v in enumerate(
            (x, conv_state, conv_weight, ssm_state, dt, A, B, C, conv_bias, D, z, dt_bias, state_batch_indices)
        )
    )
    T, batch, dim, _ = _check_update(ssm_state, x, dt, A, B, C, D, z, dt_bias, ix)
    _, _, _, _, width = _check_conv(x, conv_weight, conv_bias, "bdl", ranks=(2,))
    _need("conv_state", conv_state, (ssm_state.shape[0], dim, width - 1), (T,))
    optional = [v for v in (conv_bias, D, z, dt_bias, ix) if v is not None]
    return _ffi(
        "xla_ssm_mamba_decode_step",
        [
            jax.ShapeDtypeStruct((batch, dim), T),
            jax.ShapeDtypeStruct(conv_state.shape, T),
            jax.ShapeDtypeStruct(ssm_state.shape, ssm_state.dtype),
        ],
        [x, conv_state, conv_weight, ssm_state, dt, A, B, C, *optional],
        {1: 1, 3: 2},
        dt_softplus=_flag("dt_softplus", dt_softplus),
        has_conv_bias=np.bool_(conv_bias is not None),
        has_d=np.bool_(D is not None),
        has_z=np.bool_(z is not None),
        has_dt_bias=np.bool_(dt_bias is not None),
        has_state_batch_indices=np.bool_(ix is not None),
    )
