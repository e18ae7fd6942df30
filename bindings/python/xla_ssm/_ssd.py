"""`ssd`: Mamba-2's chunked SSD scan (docs/ssd.md), differentiable and vmappable; `ssd_ref`, the
same in pure JAX (lax.scan over the sequence).

Layers, outermost first:
  ssd                  checks shapes/dtypes in Python
  _ssd (custom_vjp)    forward saving chunk_states, backward through `xla_ssm_ssd_bwd`
  _vcall (custom_vmap) jax.vmap: folds the mapped axis into batch (a forward whose per-head
                       parameters are shared) or into heads (otherwise): never a sequential loop
  _pcall (custom_partitioning)  sharded batch / heads stay sharded; gradients of shared operands psum;
                       sharded seqlen stays sharded (_ssd_seq: summaries cross devices, not data)
  _raw                 jax.ffi.ffi_call, with the CUDA workspace (not allocated on the CPU)
The vmap and partitioning layers sit under the custom_vjp, so neither is ever differentiated.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.sharding import PartitionSpec as P

from . import _lib, _ssd_seq
from ._fold import fold_vmap
from ._scan import _dense, _ffi, _primal_values, _unused
from ._selective_scan import _as_arrays, _name, _softplus
from ._shard import partitioned, seq_axes, shard_axes

FWD = "xla_ssm_ssd_fwd"
BWD = "xla_ssm_ssd_bwd"
CHUNK_SIZES = (32, 64, 128, 256)
MAX_DSTATE = 256
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_F32 = jnp.dtype(jnp.float32)

class _Cfg(NamedTuple):
    """Everything static about one call (hashable: a jit / custom_vjp key)."""

    chunk_size: int
    dt_softplus: bool
    dt_min: float
    dt_max: float
    d_rank: int  # 0: no D, 1: (heads,), 2: (heads, headdim)
    has_z: bool
    has_dt_bias: bool
    has_initial_states: bool
    return_final_states: bool
    packed: bool = False  # cu_seqlens given: sequences packed along seqlen of batch 1


class _Call(NamedTuple):
    kind: str  # "fwd" or "bwd"
    cfg: _Cfg
    save_chunk_states: bool = False
    has_dfinal_states: bool = False


# Roles of operands and results, which say how each is sharded and vmapped (its batch axis, and the
# axis that runs over heads: over groups for B/C):
#   x: (batch, seqlen, heads, headdim); dt: (batch, seqlen, heads); bc: (batch, seqlen, groups,
#   dstate); param: (heads, ...); state: (batch, heads, headdim, dstate), packed (num_seqs, heads,
#   headdim, dstate); chunk: (batch, heads, headdim, n_chunks, dstate); cu: cu_seqlens (num_seqs + 1,).
_HEAD_AXIS = {"x": 2, "dt": 2, "bc": 2, "param": 0, "state": 1, "chunk": 1}
_PER_EXAMPLE = frozenset(("x", "dt", "bc", "state", "chunk"))  # have a batch axis (axis 0)


def _grad_roles(cfg: _Cfg):
    """The differentiable operands' roles: those the backward returns a gradient for."""
    roles = ["x", "dt", "param", "bc", "bc"]
    roles += ["param"] * (cfg.d_rank > 0) + ["x"] * cfg.has_z + ["param"] * cfg.has_dt_bias
    return roles + ["state"] * cfg.has_initial_states


def _param_roles(cfg: _Cfg):
    return _grad_roles(cfg) + ["cu"] * cfg.packed


def _in_roles(call: _Call):
    roles = _param_roles(call.cfg)
    if call.kind == "bwd":
        roles += ["chunk", "x"] + ["state"] * call.has_dfinal_states
    return roles


def _out_roles(call: _Call):
    if call.kind == "bwd":  # one gradient per differentiable operand
        return _grad_roles(call.cfg)
    return ["x", "state"] + ["chunk"] * call.save_chunk_states


# ----------------------------------------------------------------------------- the FFI calls
def _attrs(call: _Call):
    cfg = call.cfg
    attrs = dict(
        chunk_size=np.int64(cfg.chunk_size),
        has_d=np.bool_(cfg.d_rank > 0),
        has_z=np.bool_(cfg.has_z),
        has_dt_bias=np.bool_(cfg.has_dt_bias),
        has_initial_states=np.bool_(cfg.has_initial_states),
        dt_softplus=np.bool_(cfg.dt_softplus),
        dt_min=np.float32(cfg.dt_min),
        dt_max=np.float32(cfg.dt_max),
    )
    if call.kind == "fwd":
        attrs["save_chunk_states"] = np.bool_(call.save_chunk_states)
    else:
        attrs["has_dfinal_states"] = np.bool_(call.has_dfinal_states)
    if cfg.packed:
        attrs["has_cu_seqlens"] = np.bool_(True)
    return attrs


def _raw(call: _Call, *ops):
    """One FFI call on whole (or, under partitioning, per-shard) operands in ABI order."""
    return _ffi_call(call, ops)


def _ffi_call(call: _Call, ops, part_records=None):
    """_raw; a forward given `part_records` (`_ssd_seq.part_records` of the same inputs) skips the
    tensor-core split's first pass."""
    cfg = call.cfg
    x, B = ops[0], ops[3]
    batch, seqlen, heads, headdim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    lib = _lib.require(FWD if call.kind == "fwd" else BWD)
    code = _lib.dtype_code(x.dtype)
    n = len(_grad_roles(cfg))
    if cfg.packed:  # batch 1, a state row per sequence; packed calls have workspace sizes of their own
        rows = ops[n].shape[0] - 1  # num_seqs
        shape = (seqlen, rows, heads, headdim, dstate, groups, cfg.chunk_size, code)
        sizer = "xla_ssm_ssd_packed_{}_workspace_bytes"
    else:
        rows = batch
        shape = (batch, seqlen, heads, headdim, dstate, groups, cfg.chunk_size, code)
        sizer = "xla_ssm_ssd_{}_workspace_bytes"
    state = jax.ShapeDtypeStruct((rows, heads, headdim, dstate), _F32)
    n_chunks = -(-seqlen // cfg.chunk_size)
    if call.kind == "fwd":
        results = [jax.ShapeDtypeStruct(x.shape, x.dtype), state]
        if call.save_chunk_states:
            # x's dtype where the tensor-core kernels run, else f32: the same on every platform
            # and shard (it depends on headdim, dstate, chunk_size and the dtype only).
            chunk_dtype = _FLOATS[lib.xla_ssm_ssd_chunk_states_dtype(headdim, dstate, cfg.chunk_size, code)]
            results.append(jax.ShapeDtypeStruct((batch, heads, headdim, n_chunks, dstate), chunk_dtype))
        ws = _lib.size(sizer.format("fwd"), *shape)
        attrs = _attrs(call)
        if part_records is not None:
            ops = (*ops, part_records)
            attrs["has_part_records"] = np.bool_(True)
        return _ffi(FWD, results, ws, ops, attrs)
    results = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in ops[:n]]  # gradients: primal shapes and dtypes
    ws = _lib.size(sizer.format("bwd"), *shape)
    return _ffi(BWD, results, ws, ops, _attrs(call))


# ------------------------------------------------------------------------------- sharding
def _chunked(call: _Call):
    """Whether the call reads or writes chunk_states (then seqlen shards must be whole chunks)."""
    return call.kind == "bwd" or call.save_chunk_states


def _shard_plan(call: _Call, mesh, arg_shapes):
    """(batch, heads, groups, seqlen) mesh axes from x's sharding; headdim and dstate are never
    sharded, nor seqlen of packed sequences."""
    x = arg_shapes[0]
    chunk = call.cfg.chunk_size if _chunked(call) else 0
    lax = () if call.cfg.packed else seq_axes(mesh, x, 1, x.shape[1], chunk)
    return (*shard_axes(mesh, x, _HEAD_AXIS["x"], arg_shapes[3].shape[2]), lax)


def _spec(call: _Call, role, plan):
    b, h, g, l = (a or None for a in plan)
    sb = None if call.cfg.packed else b  # packed: the state rows are sequences, never split
    return {
        "x": P(b, l, h, None), "dt": P(b, l, h), "bc": P(b, l, g, None), "param": P(h),
        "state": P(sb, h, None, None), "chunk": P(b, h, None, l, None), "cu": P(None),
    }[role]  # fmt: skip


def _psum_axes(call: _Call, role, plan):
    """A gradient is a partial sum on each shard that shares its operand: per-head parameters (A,
    D, dt_bias) across batch and seqlen shards, B/C (summed over its group's heads) across head
    shards when its groups are not split. (With seqlen sharded, the initial states' gradient is
    formed whole on every shard.)"""
    bax, hax, gax, lax = plan
    if role == "param":
        return bax + lax
    return hax if role == "bc" and not gax else ()


# param: A and dt_bias are (h), D is (h) or (h p).
_LETTERS = {"x": "b l h p", "dt": "b l h", "bc": "b l g n", "param": "h p", "state": "b h p n", "chunk": "b h p k n"}


def _factors(call: _Call, role, shape):
    if role == "cu":
        return "c"
    if role == "state" and call.cfg.packed:  # rows are sequences, not batch entries
        return "s h p n"
    letters = " ".join(_LETTERS[role].split()[: len(shape)])
    if role in ("x", "dt", "bc") and _chunked(call) and shape[1] % call.cfg.chunk_size == 0:
        # seqlen is chunks x steps: a seqlen sharding propagates to chunk_states, which then stay
        # sharded from the forward to the backward.
        letters = letters.replace("l", "(k r)")
    return letters


def _factor_sizes(call: _Call):
    return {"r": call.cfg.chunk_size}


def _seq_lower(call: _Call, plan, mesh):
    return _ssd_seq.lower(call, plan[3], mesh, _ffi_call) if plan[3] else None


# Batch, heads (groups) and seqlen (with the chunk axis) pass through; headdim, dstate, and packed
# sequences' rows and boundaries must not be sharded.
_pcall = partitioned(
    _raw, _in_roles, _out_roles, _shard_plan, _spec, _psum_axes, _factors, "pncsr", _seq_lower, _factor_sizes
)


# ----------------------------------------------------------------------------------- vmap
@functools.lru_cache(maxsize=None)
def _vcall_fn(call: _Call):
    f = custom_vmap(lambda *ops: _pcall(call, *ops))
    f.def_vmap(functools.partial(_vmap_rule, call, f))
    return f


def _vcall(call: _Call, *ops):
    return _vcall_fn(call)(*ops)


def _vmap_rule(call: _Call, f, axis_size, in_batched, *ops):
    """jax.vmap of one call, in one call. The mapped axis (k) joins batch when it can (a forward
    whose per-head parameters are shared: a free reshape), else heads (and groups): the k examples
    become k*heads heads, each with its own copy of the parameters, so the backward's per-head
    gradient sums stay per example (what vmap of a gradient means) and mapped parameters need no
    loop. Head j of example i is head i*heads + j and reads group i*groups + j // (heads/groups):
    the groups fold the same way. Packed calls (batch 1, boundaries of their own) run one example
    at a time."""
    if call.cfg.packed:
        mapped = tuple(x for x, b in zip(ops, in_batched) if b)

        def one(xs):
            it = iter(xs)
            return f(*(next(it) if b else x for x, b in zip(ops, in_batched)))

        res = jax.lax.map(one, mapped)
        return tuple(res), (True,) * len(res)
    return fold_vmap(
        f, axis_size, _in_roles(call), _out_roles(call), ops, in_batched, _PER_EXAMPLE, call.kind == "fwd",
        _HEAD_AXIS.__getitem__,
    )


# ------------------------------------------------------------------------------ custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ssd(cfg: _Cfg, ops):
    y, final_states = _vcall(_Call("fwd", cfg), *ops)
    return y, final_states


def _ssd_fwd(cfg: _Cfg, ops):
    ops = _primal_values(ops)
    y, final_states, chunk_states = _vcall(_Call("fwd", cfg, save_chunk_states=True), *ops)
    return (y, final_states), (ops, chunk_states)


def _ssd_bwd(cfg: _Cfg, res, cts):
    ops, chunk_states = res
    dy, dfinal_states = cts
    args = [*ops, chunk_states, _dense(dy).astype(ops[0].dtype)]
    # As in _scan_bwd: an unreturned or unused final state's zero cotangent is not passed (a packed
    # backward without states runs on the tensor cores, with them as a selective scan).
    has_dfinal = cfg.return_final_states and not _unused(dfinal_states)
    if has_dfinal:
        args.append(dfinal_states.astype(_F32))
    grads = tuple(_vcall(_Call("bwd", cfg, has_dfinal_states=has_dfinal), *args))
    if cfg.packed:  # the boundaries are integers: no gradient
        grads += (np.zeros(ops[-1].shape, jax.dtypes.float0),)
    return (grads,)


_ssd.defvjp(_ssd_fwd, _ssd_bwd, symbolic_zeros=True)


# ------------------------------------------------------------------------------ public API
def _effective_limit(dt_min, dt_max):
    """The clamp the targets apply: the default (0, inf) means none, as in Mamba's reference (the
    targets always clamp, so it becomes (-inf, inf))."""
    return (-math.inf, math.inf) if (dt_min, dt_max) == (0.0, math.inf) else (dt_min, dt_max)


def _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit, initial_states, final, num_seqs=None):
    """Validate against docs/ssd.md (num_seqs: packed sequences' count, whose states are per
    sequence); returns (d_rank, dt_min, dt_max)."""
    for name, v in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        if not hasattr(v, "shape") or not hasattr(v, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(v).__name__}")
    for name, v in (("dt_softplus", dt_softplus), ("return_final_states", final)):
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{name} must be a Python bool (static under jit), got {type(v).__name__}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")
    try:
        dt_min, dt_max = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise TypeError(f"dt_limit must be a pair of Python floats (dt_min, dt_max), got {dt_limit!r}") from None
    if not (dt_min <= dt_max and dt_min < math.inf and dt_max > -math.inf):
        raise ValueError(
            f"dt_limit must have dt_min <= dt_max (not NaN, dt_min < inf, dt_max > -inf), got {dt_limit!r}"
        )
    dt_min, dt_max = _effective_limit(dt_min, dt_max)

    if x.ndim != 4:
        raise ValueError(f"x must have rank 4 (batch, seqlen, heads, headdim), got shape {tuple(x.shape)}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {_name(x.dtype)}")
    batch, seqlen, heads, headdim = x.shape
    T = x.dtype

    def expect(name, v, shape, like_x, meaning):
        """v has `shape`, and the dtype of x (like_x) or float32."""
        if tuple(v.shape) != shape:
            raise ValueError(f"{name} must have shape {meaning}={shape}, got {tuple(v.shape)}")
        if v.dtype != (T if like_x else _F32):
            what = f"the dtype of x ({_name(T)})" if like_x else "float32"
            raise TypeError(f"{name} must be {what}, got {_name(v.dtype)}")

    expect("dt", dt, (batch, seqlen, heads), True, "(batch, seqlen, heads)")
    expect("A", A, (heads,), False, "(heads,)")
    if B.ndim != 4 or tuple(B.shape[:2]) != (batch, seqlen):
        raise ValueError(
            f"B must have shape (batch, seqlen, groups, dstate)=({batch}, {seqlen}, ., .), got {tuple(B.shape)}"
        )
    groups, dstate = B.shape[2], B.shape[3]
    if groups < 1 or heads % groups:
        raise ValueError(f"heads ({heads}) must be a multiple of groups ({groups}), groups >= 1")
    if not 1 <= dstate <= MAX_DSTATE:
        raise ValueError(f"dstate (B.shape[3]) must be in [1, {MAX_DSTATE}], got {dstate}")
    expect("B", B, (batch, seqlen, groups, dstate), True, "(batch, seqlen, groups, dstate)")
    expect("C", C, (batch, seqlen, groups, dstate), True, "(batch, seqlen, groups, dstate)")
    d_rank = 0
    if D is not None:
        d_rank = D.ndim
        if d_rank == 1:
            expect("D", D, (heads,), False, "(heads,)")
        elif d_rank == 2:
            expect("D", D, (heads, headdim), False, "(heads, headdim)")
        else:
            raise ValueError(
                f"D must have shape (heads,)=({heads},) or (heads, headdim)=({heads}, {headdim}), got {tuple(D.shape)}"
            )
    if z is not None:
        expect("z", z, tuple(x.shape), True, "(batch, seqlen, heads, headdim)")
    if dt_bias is not None:
        expect("dt_bias", dt_bias, (heads,), False, "(heads,)")
    if initial_states is not None:
        if num_seqs is None:
            state, meaning = (batch, heads, headdim, dstate), "(batch, heads, headdim, dstate)"
        else:
            state, meaning = (num_seqs, heads, headdim, dstate), "(num_seqs, heads, headdim, dstate)"
        expect("initial_states", initial_states, state, False, meaning)
    return d_rank, dt_min, dt_max


def _check_cu_seqlens(cu_seqlens, x):
    """cu_seqlens as an int32 array, checked against x (batch 1); its values too when they are
    concrete (not traced)."""
    if not hasattr(cu_seqlens, "shape"):
        cu_seqlens = np.asarray(cu_seqlens)
    if x.ndim != 4 or x.shape[0] != 1:
        raise ValueError(
            f"cu_seqlens packs sequences along seqlen of one batch row: x must be (1, seqlen, heads, headdim), "
            f"got shape {tuple(x.shape)}"
        )
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1 or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise ValueError(
            "cu_seqlens must be a rank-1 integer array (num_seqs + 1,), "
            f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    seqlen = x.shape[1]
    if not isinstance(cu_seqlens, jax.core.Tracer):
        v = np.asarray(cu_seqlens)
        if v[0] != 0 or v[-1] != seqlen or np.any(np.diff(v) < 0):
            raise ValueError(
                f"cu_seqlens must start at 0, never decrease and end at seqlen (= {seqlen}), got {v.tolist()}"
            )
    return jnp.asarray(cu_seqlens, jnp.int32)


def ssd(
    x,
    dt,
    A,
    B,
    C,
    chunk_size=256,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    initial_states=None,
    return_final_states=False,
    cu_seqlens=None,
):
    """Mamba-2's chunked SSD scan (docs/ssd.md) through libxla_ssm, differentiable.

    x, z: (batch, seqlen, heads, headdim); dt: (batch, seqlen, heads); B, C: (batch, seqlen,
    groups, dstate), head h reading group h // (heads // groups); these share one dtype (float32,
    bfloat16 or float16). A, dt_bias: (heads,) float32; D: (heads,) or (heads, headdim) float32;
    initial_states: (batch, heads, headdim, dstate) float32. Per head and step,
    dt' = clip(softplus?(dt + dt_bias), *dt_limit), S = exp(dt' A) S + dt' x B^T, y = S C + D x,
    times silu(z). The default dt_limit (0, inf) does not clamp, as in Mamba's reference; any other
    pair clamps (the gradient passes where dt_min <= dt' <= dt_max). `chunk_size` (32, 64, 128 or 256), `dt_softplus`,
    `dt_limit` and `return_final_states` are static.

    Returns y (like x), and with return_final_states=True also final_states (batch, heads,
    headdim, dstate) float32. Differentiable in every array argument (the forward saves the state
    entering each chunk, the backward recomputes within chunks), batchable with jax.vmap (A, D and
    dt_bias may be mapped too), and under jax.jit with inputs sharded over batch and/or heads it
    runs on the shards without gathering them (docs/ssd.md, "Sharding").

    cu_seqlens: int32 (num_seqs + 1,), sequences packed along seqlen of a batch-1 x (docs/ssd.md,
    "Packed sequences"): boundaries 0 = cu[0] <= cu[1] <= ... <= cu[-1] = seqlen. The state resets
    at each boundary, to initial_states[s] ((num_seqs, heads, headdim, dstate)) or zeros; the final
    states are then (num_seqs, heads, headdim, dstate), and no gradient crosses a boundary. Concrete
    boundaries are checked here (ValueError); traced ones are checked by the CPU target, while on
    CUDA invalid ones give undefined (but memory-safe) results. Not differentiable; under jax.vmap
    packed calls run one example at a time.
    """
    x, dt, A, B, C, D, z, dt_bias, initial_states = _as_arrays(x, dt, A, B, C, D, z, dt_bias, initial_states)
    num_seqs = None
    if cu_seqlens is not None:
        for name, v in (("x", x), ("B", B)):
            if not hasattr(v, "shape") or not hasattr(v, "dtype"):
                raise TypeError(f"{name} must be an array, got {type(v).__name__}")
        cu_seqlens = _check_cu_seqlens(cu_seqlens, x)
        num_seqs = cu_seqlens.shape[0] - 1
    d_rank, dt_min, dt_max = _check(
        x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit, initial_states, return_final_states, num_seqs
    )
    cfg = _Cfg(
        chunk_size=int(chunk_size),
        dt_softplus=bool(dt_softplus),
        dt_min=dt_min,
        dt_max=dt_max,
        d_rank=d_rank,
        has_z=z is not None,
        has_dt_bias=dt_bias is not None,
        has_initial_states=initial_states is not None,
        return_final_states=bool(return_final_states),
        packed=cu_seqlens is not None,
    )
    ops = tuple(v for v in (x, dt, A, B, C, D, z, dt_bias, initial_states, cu_seqlens) if v is not None)
    y, final_states = _ssd(cfg, ops)
    return (y, final_states) if return_final_states else y


def ssd_ref(
    x,
    dt,
    A,
    B,
    C,
    chunk_size=256,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    initial_states=None,
    return_final_states=False,
    cu_seqlens=None,
):
    """Pure-JAX reference of `ssd` (the plain recurrence, `jax.lax.scan` over seqlen), same
    signature and results (`chunk_size` only fixes the kernel's residuals: unused here). Arithmetic
    in float32 (float64 if every input is float64 and x64 is on); y is cast to x's dtype. With
    cu_seqlens (concrete values only) it runs each sequence on its own and puts them together."""
    if cu_seqlens is not None:
        return _ssd_ref_packed(
            x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit, initial_states, return_final_states,
            cu_seqlens,
        )  # fmt: skip
    x, dt, A, B, C, D, z, dt_bias, initial_states = _as_arrays(x, dt, A, B, C, D, z, dt_bias, initial_states)
    acc = jnp.promote_types(jnp.float32, jnp.result_type(x, dt, A, B, C))
    out_dtype = x.dtype

    def f(v):
        return None if v is None else v.astype(acc)

    x, dt, A, B, C, D, z, dt_bias, h0 = map(f, (x, dt, A, B, C, D, z, dt_bias, initial_states))
    batch, seqlen, heads, headdim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = _softplus(dt)
    dt = jnp.clip(dt, *_effective_limit(float(dt_limit[0]), float(dt_limit[1])))
    # Head h reads group h // (heads // groups).
    Bh = jnp.repeat(B, heads // groups, axis=2)  # (batch, seqlen, heads, dstate)
    Ch = jnp.repeat(C, heads // groups, axis=2)
    s0 = jnp.zeros((batch, heads, headdim, dstate), acc) if h0 is None else h0

    def step(s, xs):
        dt_t, x_t, b_t, c_t = xs  # (batch, heads), (batch, heads, headdim), (batch, heads, dstate) x2
        decay = jnp.exp(dt_t * A)[..., None, None]
        s = decay * s + (dt_t[..., None] * x_t)[..., None] * b_t[:, :, None, :]
        # Elementwise, not a dot: GPUs would run an f32 dot in TF32.
        return s, jnp.sum(s * c_t[:, :, None, :], axis=-1)

    xs = tuple(jnp.moveaxis(v, 1, 0) for v in (dt, x, Bh, Ch))
    s, ys = jax.lax.scan(step, s0, xs, length=seqlen)
    y = jnp.moveaxis(ys, 0, 1)  # (batch, seqlen, heads, headdim)
    if D is not None:
        y = y + (D[:, None] if D.ndim == 1 else D) * x
    if z is not None:
        y = y * (z * jax.nn.sigmoid(z))
    y = y.astype(out_dtype)
    return (y, s) if return_final_states else y


def _ssd_ref_packed(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit, h0, final, cu_seqlens):
    """`ssd_ref` over packed sequences: one call per sequence (x[:, cu[s]:cu[s+1]], its initial
    state row), y put back together along seqlen and the final states stacked."""
    if isinstance(cu_seqlens, jax.core.Tracer):
        raise ValueError("ssd_ref: cu_seqlens must be concrete (it loops over the sequences in Python)")
    cu = np.asarray(cu_seqlens).tolist()
    x, dt, A, B, C, D, z, dt_bias, h0 = _as_arrays(x, dt, A, B, C, D, z, dt_bias, h0)
    heads, headdim, dstate = x.shape[2], x.shape[3], B.shape[3]
    ys, finals = [], []
    for s in range(len(cu) - 1):
        lo, hi = cu[s], cu[s + 1]
        part = lambda v: None if v is None else v[:, lo:hi]  # noqa: E731
        row = None if h0 is None else h0[s : s + 1]
        y, last = ssd_ref(
            x[:, lo:hi], part(dt), A, B[:, lo:hi], part(C), chunk_size, D, part(z), dt_bias, dt_softplus, dt_limit,
            row, True,
        )  # fmt: skip
        ys.append(y)
        finals.append(last)
    y = jnp.concatenate(ys, axis=1) if ys else jnp.zeros(x.shape, x.dtype)
    acc = jnp.float32 if not finals else finals[0].dtype
    s = jnp.concatenate(finals, axis=0) if finals else jnp.zeros((0, heads, headdim, dstate), acc)
    return (y, s) if final else y
