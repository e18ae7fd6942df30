"""`selective_scan`: the differentiable, vmappable, shardable selective scan.

Layers, outermost first:
  selective_scan       checks shapes/dtypes in Python, folds extra leading dims into batch
  _scan (custom_vjp)   forward with checkpoints, backward through `xla_ssm_selective_scan_bwd`
  _vcall (custom_vmap) jax.vmap: folds the mapped axis into batch (forward, parameters unmapped)
                       or into dim (otherwise): never a sequential loop
  _pcall (custom_partitioning)  sharded batch / dim stay sharded; gradients of shared operands psum;
                       sharded seqlen stays sharded (_scan_seq: summaries cross devices, not data)
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
from jax.custom_derivatives import SymbolicZero
from jax.sharding import PartitionSpec as P

from . import _lib, _scan_seq
from ._fold import fold_vmap
from ._selective_scan import _as_arrays, _check
from ._shard import partitioned, seq_axes, shard_axes

FWD = "xla_ssm_selective_scan_fwd"
BWD = "xla_ssm_selective_scan_bwd"
# The forward saves the state entering every CHECKPOINT_LEN-th step for the backward (a multiple
# of 32, docs/selective_scan_bwd.md): residuals of batch*dim*dstate*ceil(seqlen/32) f32, as large as
# a bf16 u when dstate is 16. 32 spares the CUDA backward a recompute pass (H100, backward kernel:
# 2172 us at 32 against 2404 at 64); 64 halves the memory.
CHECKPOINT_LEN = 32
_F32 = jnp.dtype(jnp.float32)


class _Cfg(NamedTuple):
    """Everything static about one call (hashable: a jit / custom_vjp / partitioning key)."""

    delta_softplus: bool
    layout: str
    bc_rank: int  # 4: time-varying B/C, 2: time-invariant
    has_d: bool
    has_z: bool
    has_delta_bias: bool
    has_initial_state: bool
    return_final_state: bool
    packed: bool = False  # cu_seqlens given: sequences packed along seqlen of batch 1


class _Call(NamedTuple):
    kind: str  # "fwd" or "bwd"
    cfg: _Cfg
    checkpoint_len: int  # 0: a forward without checkpoints
    has_dfinal_state: bool = False


# Roles of operands and results, which say how each is sharded and vmapped:
#   x: like u; A: (dim, dstate); bc4: time-varying B/C; bc2: (dim, dstate) B/C; vec: (dim,);
#   state: (batch, dim, dstate), packed (num_seqs, dim, dstate); ckpt: (batch, dim, n_checkpoints,
#   dstate); cu: cu_seqlens (num_seqs + 1,).
def _grad_roles(cfg: _Cfg):
    """The differentiable operands' roles: those the backward returns a gradient for."""
    bc = "bc4" if cfg.bc_rank == 4 else "bc2"
    roles = ["x", "x", "A", bc, bc]
    roles += ["vec"] * cfg.has_d + ["x"] * cfg.has_z + ["vec"] * cfg.has_delta_bias
    return roles + ["state"] * cfg.has_initial_state


def _param_roles(cfg: _Cfg):
    return _grad_roles(cfg) + ["cu"] * cfg.packed


def _in_roles(call: _Call):
    roles = _param_roles(call.cfg)
    if call.kind == "bwd":
        roles += ["ckpt", "x"] + ["state"] * call.has_dfinal_state
    return roles


def _out_roles(call: _Call):
    if call.kind == "bwd":  # one gradient per differentiable operand
        return _grad_roles(call.cfg)
    return ["x", "state"] + ["ckpt"] * (call.checkpoint_len > 0)


_PER_EXAMPLE = frozenset(("x", "bc4", "state", "ckpt"))  # have a batch axis (axis 0)


def _dim_axis(role, layout):
    """The axis of a role's array that runs over dim (over groups for bc4)."""
    if role in ("x", "bc4"):
        return 1 if layout == "bdl" else 2
    return 1 if role in ("state", "ckpt") else 0


def _sizes(cfg: _Cfg, u, A, B):
    if cfg.layout == "bdl":
        batch, dim, seqlen = u.shape
    else:
        batch, seqlen, dim = u.shape
    groups = (B.shape[1] if cfg.layout == "bdl" else B.shape[2]) if cfg.bc_rank == 4 else 0
    return batch, dim, seqlen, A.shape[1], groups


# ----------------------------------------------------------------------------- the FFI calls
def _ffi(target, results, workspace_bytes, operands, attrs):
    """ffi_call with `workspace_bytes` of scratch as a last, discarded result, on CUDA only (the CPU
    targets ignore it: no reason to allocate it there)."""
    n = len(results)

    def run(with_workspace, *ops):
        res = list(results)
        if with_workspace:
            res.append(jax.ShapeDtypeStruct((workspace_bytes,), jnp.uint8))
        return tuple(jax.ffi.ffi_call(target, tuple(res))(*ops, **attrs)[:n])

    if workspace_bytes <= 0:
        return run(False, *operands)
    return jax.lax.platform_dependent(
        *operands, cpu=functools.partial(run, False), default=functools.partial(run, True)
    )


def _attrs(cfg: _Cfg):
    return dict(
        delta_softplus=np.bool_(cfg.delta_softplus),
        has_d=np.bool_(cfg.has_d),
        has_z=np.bool_(cfg.has_z),
        has_delta_bias=np.bool_(cfg.has_delta_bias),
        has_initial_state=np.bool_(cfg.has_initial_state),
        layout=cfg.layout,
        **({"has_cu_seqlens": np.bool_(True)} if cfg.packed else {}),
    )


def _raw(call: _Call, *ops):
    """One FFI call on whole (or, under partitioning, per-shard) operands in ABI order."""
    return _ffi_call(call, ops)


def _ffi_call(call: _Call, ops, chunk_records=None):
    """_raw; a forward given `chunk_records` (`_scan_seq._Shard.chunk_records` of the same inputs)
    skips the CUDA split's first pass."""
    cfg = call.cfg
    u, A, B = ops[0], ops[2], ops[3]
    batch, dim, seqlen, dstate, groups = _sizes(cfg, u, A, B)
    attrs = _attrs(cfg)
    if chunk_records is not None:
        ops = (*ops, chunk_records)
        attrs["has_chunk_records"] = np.bool_(True)
    n_ck = -(-seqlen // call.checkpoint_len) if call.checkpoint_len else 0
    state_rows = ops[len(_grad_roles(cfg))].shape[0] - 1 if cfg.packed else batch  # packed: num_seqs
    if call.kind == "fwd":
        results = [jax.ShapeDtypeStruct(u.shape, u.dtype), jax.ShapeDtypeStruct((state_rows, dim, dstate), _F32)]
        if call.checkpoint_len:
            attrs["checkpoint_len"] = np.int64(call.checkpoint_len)
            results.append(jax.ShapeDtypeStruct((batch, dim, n_ck, dstate), _F32))
        ws = _lib.size("xla_ssm_selective_scan_fwd_workspace_bytes", batch, dim, seqlen, dstate)
        return _ffi(FWD, results, ws, ops, attrs)
    _lib.require(BWD)
    attrs["checkpoint_len"] = np.int64(call.checkpoint_len)
    attrs["has_dfinal_state"] = np.bool_(call.has_dfinal_state)
    n = len(_grad_roles(cfg))
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in ops[:n]]  # gradients: primal shapes and dtypes
    ws = _lib.size("xla_ssm_selective_scan_bwd_workspace_bytes", batch, dim, seqlen, dstate, groups)
    return _ffi(BWD, results, ws, ops, attrs)


# ------------------------------------------------------------------------------- sharding
def _shard_plan(call: _Call, mesh, arg_shapes):
    """(batch, dim, groups, seqlen) mesh axes from u's sharding; dstate is never sharded, nor seqlen
    of packed sequences."""
    u, A, B = arg_shapes[0], arg_shapes[2], arg_shapes[3]
    _, _, seqlen, _, groups = _sizes(call.cfg, u, A, B)
    l_axis = 2 if call.cfg.layout == "bdl" else 1
    lax = () if call.cfg.packed else seq_axes(mesh, u, l_axis, seqlen, call.checkpoint_len)
    return (*shard_axes(mesh, u, _dim_axis("x", call.cfg.layout), groups), lax)


def _spec(call: _Call, role, plan):
    b, d, g, l = (a or None for a in plan)
    if role == "x":
        return P(b, d, l) if call.cfg.layout == "bdl" else P(b, l, d)
    if role == "bc4":
        return P(b, g, None, l) if call.cfg.layout == "bdl" else P(b, l, g, None)
    if role in ("A", "bc2"):
        return P(d, None)
    if role == "vec":
        return P(d)
    if role == "state":  # packed: one row per sequence, never split
        return P(None if call.cfg.packed else b, d, None)
    if role == "cu":
        return P(None)
    return P(b, d, l, None)  # ckpt: its axis runs along seqlen


def _psum_axes(call: _Call, role, plan):
    """A gradient is a partial sum on each shard that shares its operand: per-dim parameters (A, D,
    delta_bias, time-invariant B/C) across batch and seqlen shards, time-varying B/C (per batch
    element, summed over its group's channels) across dim shards when its groups are not split.
    (With seqlen sharded, the initial state's gradient is formed whole on every shard.)"""
    bax, dax, gax, lax = plan
    if role in ("A", "bc2", "vec"):
        return bax + lax
    return dax if role == "bc4" and not gax else ()


_LETTERS = {
    ("x", "bdl"): "b d l", ("x", "bld"): "b l d", ("bc4", "bdl"): "b g n l", ("bc4", "bld"): "b l g n",
    "A": "d n", "bc2": "d n", "vec": "d", "state": "b d n", "ckpt": "b d k n",
}  # fmt: skip


def _factors(call: _Call, role, shape):
    if role == "cu":
        return "c"
    if role == "state" and call.cfg.packed:  # rows are sequences, not batch entries
        return "s d n"
    letters = _LETTERS.get((role, call.cfg.layout)) or _LETTERS[role]
    if role in ("x", "bc4") and call.checkpoint_len:
        # seqlen is checkpoints x steps between them, when it divides: a seqlen sharding then
        # propagates to the checkpoints, which stay sharded from the forward to the backward.
        seqlen = shape[letters.split().index("l")]
        if seqlen % call.checkpoint_len == 0:
            letters = letters.replace("l", "(k r)")
    return letters


def _factor_sizes(call: _Call):
    return {"r": call.checkpoint_len}


def _seq_lower(call: _Call, plan, mesh):
    return _scan_seq.lower(call, plan[3], mesh, _ffi_call) if plan[3] else None


# Batch, dim and seqlen (with the checkpoint axis) pass through; dstate, and packed sequences' rows
# and boundaries must not be sharded.
_pcall = partitioned(
    _raw, _in_roles, _out_roles, _shard_plan, _spec, _psum_axes, _factors, "ncsr", _seq_lower, _factor_sizes
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
    whose per-dim parameters are shared: a free reshape), else dim: the k examples become k*dim
    channels, each with its own copy of the parameters, so the backward's per-dim gradient sums stay
    per example (what vmap of a gradient means) and mapped parameters need no loop."""
    if call.cfg.packed:
        # Packed streams have batch 1 and their own boundaries: one call per example.
        mapped = tuple(x for x, b in zip(ops, in_batched) if b)

        def one(xs):
            it = iter(xs)
            return f(*(next(it) if b else x for x, b in zip(ops, in_batched)))

        res = jax.lax.map(one, mapped)
        return tuple(res), (True,) * len(res)
    axis_of = functools.partial(_dim_axis, layout=call.cfg.layout)
    return fold_vmap(
        f, axis_size, _in_roles(call), _out_roles(call), ops, in_batched, _PER_EXAMPLE, call.kind == "fwd", axis_of
    )


# ------------------------------------------------------------------------------ custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan(cfg: _Cfg, ops):
    out, final_state = _vcall(_Call("fwd", cfg, 0), *ops)
    return out, final_state


def _primal_values(ops):
    """The arrays of a `symbolic_zeros` forward rule's arguments (each comes as a CustomVJPPrimal)."""
    return tuple(op.value for op in ops)


def _unused(ct):
    """True for a cotangent JAX knows is zero: the caller never used that result."""
    return isinstance(ct, SymbolicZero)


def _dense(ct):
    """A cotangent as an array (zeros for a symbolic zero: the kernels read every operand)."""
    return jnp.zeros(ct.shape, ct.dtype) if _unused(ct) else ct


def _scan_fwd(cfg: _Cfg, ops):
    ops = _primal_values(ops)
    out, final_state, checkpoints = _vcall(_Call("fwd", cfg, CHECKPOINT_LEN), *ops)
    return (out, final_state), (ops, checkpoints)


def _scan_bwd(cfg: _Cfg, res, cts):
    ops, checkpoints = res
    dout, dfinal_state = cts
    args = [*ops, checkpoints, _dense(dout).astype(ops[0].dtype)]
    # A final state the caller never returned, or never used, has a zero cotangent: the backward
    # then takes none (it reads no zeros, and a packed call keeps its fast path).
    has_dfinal = cfg.return_final_state and not _unused(dfinal_state)
    if has_dfinal:
        args.append(dfinal_state.astype(_F32))
    grads = tuple(_vcall(_Call("bwd", cfg, CHECKPOINT_LEN, has_dfinal), *args))
    if cfg.packed:  # the boundaries are integers: no gradient
        grads += (np.zeros(ops[-1].shape, jax.dtypes.float0),)
    return (grads,)


_scan.defvjp(_scan_fwd, _scan_bwd, symbolic_zeros=True)


# ------------------------------------------------------------------------------ public API
def _split_lead(name, x, lead, core_rank):
    """Whether x has u's leading dims `lead` (True) or none (False: shared); else an error."""
    if x.ndim == core_rank + len(lead) and len(lead) and tuple(x.shape[: len(lead)]) == lead:
        return True
    if x.ndim == core_rank:
        return False
    raise ValueError(
        f"{name} must have u's leading dims {lead} followed by {core_rank} dims, or just the "
        f"{core_rank} dims (shared), got shape {tuple(x.shape)}"
    )


def selective_scan(
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
    return_final_state=False,
    layout="bdl",
    cu_seqlens=None,
):
    """Mamba-1 selective scan (docs/selective_scan_fwd.md) through libxla_ssm, differentiable.

    u, delta, z: (..., batch, dim, seqlen), or (..., batch, seqlen, dim) with layout="bld";
    A: (dim, dstate) f32; B, C: (..., batch, groups, dstate, seqlen) (layout "bld":
    (..., batch, seqlen, groups, dstate)) or time-invariant (dim, dstate); D, delta_bias: (dim,) f32;
    initial_state: (..., batch, dim, dstate) f32. Leading dims `...` (u's) fold into batch; B, C and
    initial_state may omit them (shared). `delta_softplus`, `return_final_state` and `layout` are
    static Python values.

    Returns out (like u), and with return_final_state=True also the final state
    (..., batch, dim, dstate) f32. Differentiable in every array argument (jax.grad: the forward
    saves a state every CHECKPOINT_LEN steps, the backward recomputes between them), batchable with
    jax.vmap (A, D, delta_bias may be mapped too), and under jax.jit with inputs sharded over batch
    and/or dim it runs on the shards without gathering them.

    cu_seqlens: int32 (num_seqs + 1,), sequences packed along seqlen of a batch-1 u (no leading
    dims): boundaries 0 = cu[0] <= cu[1] <= ... <= cu[-1] = seqlen. The state resets at each
    boundary, to initial_state[s] ((num_seqs, dim, dstate)) or zeros; the final state is then
    (num_seqs, dim, dstate), and gradients do not cross boundaries. Concrete boundaries are checked
    here; traced ones are checked by the CPU target, while on CUDA invalid ones give undefined
    (but memory-safe) results. Under jax.vmap packed calls run one example at a time.
    """
    u, delta, A, B, C, D, z, delta_bias, initial_state = _as_arrays(
        u, delta, A, B, C, D, z, delta_bias, initial_state
    )
    if not isinstance(return_final_state, (bool, np.bool_)):
        raise TypeError(
            f"return_final_state must be a Python bool (static under jit), got {type(return_final_state).__name__}"
        )
    for name, x in (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if u.ndim < 3:
        raise ValueError(f"u must have rank 3 (batch, dim, seqlen) after any leading dims, got shape {tuple(u.shape)}")
    packed_h0 = None
    if cu_seqlens is not None:
        cu_seqlens = _check_cu_seqlens(cu_seqlens, u, layout)
        if initial_state is not None:  # checked here: _check knows only per-batch states
            want = (cu_seqlens.shape[0] - 1, u.shape[1] if layout == "bdl" else u.shape[2], A.shape[-1])
            if tuple(initial_state.shape) != want or initial_state.dtype != _F32:
                raise ValueError(
                    f"initial_state with cu_seqlens must be float32 of shape (num_seqs, dim, dstate) = {want}, "
                    f"got {initial_state.dtype} {tuple(initial_state.shape)}"
                )
            packed_h0, initial_state = initial_state, None
    lead = tuple(u.shape[:-3])
    nl = len(lead)
    # u's leading dims: delta and z carry them too; B, C and initial_state carry them or are shared.
    for name, x in (("delta", delta), ("z", z)):
        if nl and x is not None and tuple(x.shape) != tuple(u.shape):
            raise ValueError(f"{name} must have the shape of u {tuple(u.shape)}, got {tuple(x.shape)}")
    h0_lead = nl > 0 and initial_state is not None and _split_lead("initial_state", initial_state, lead, 3)
    bc_lead = False
    if nl and B.ndim >= 4:
        bc_lead = _split_lead("B", B, lead, 4)
        if _split_lead("C", C, lead, 4) != bc_lead:
            raise ValueError(f"C must have the shape of B {tuple(B.shape)}, got {tuple(C.shape)}")

    def view(x, stripped):
        return None if x is None else jax.ShapeDtypeStruct(x.shape[nl:] if stripped else x.shape, x.dtype)

    # The per-example checks, on the shapes without the leading dims.
    _check(
        view(u, True), view(delta, True), A, view(B, bc_lead), view(C, bc_lead), D, view(z, True),
        delta_bias, delta_softplus, view(initial_state, h0_lead), layout,
    )  # fmt: skip
    if packed_h0 is not None:
        initial_state = packed_h0
    cfg = _Cfg(
        packed=cu_seqlens is not None,
        delta_softplus=bool(delta_softplus),
        layout=layout,
        bc_rank=B.ndim - nl * bc_lead,
        has_d=D is not None,
        has_z=z is not None,
        has_delta_bias=delta_bias is not None,
        has_initial_state=initial_state is not None,
        return_final_state=bool(return_final_state),
    )
    n = math.prod(lead)

    def fold(x, has_lead, rank):
        """(*lead, batch, ...) -> (n*batch, ...); a shared operand is broadcast first."""
        if not nl:
            return x
        if not has_lead:
            x = jnp.broadcast_to(x, (*lead, *x.shape))
        return x.reshape(n * x.shape[nl], *x.shape[nl + 1 :])

    ops = [fold(u, True, 3), fold(delta, True, 3), A]
    if cfg.bc_rank == 4:
        ops += [fold(B, bc_lead, 4), fold(C, bc_lead, 4)]
    else:
        ops += [B, C]
    ops += [D] if D is not None else []
    ops += [fold(z, True, 3)] if z is not None else []
    ops += [delta_bias] if delta_bias is not None else []
    if initial_state is not None:
        ops.append(fold(initial_state, h0_lead, 3))
    if cu_seqlens is not None:
        ops.append(cu_seqlens)
    out, final_state = _scan(cfg, tuple(ops))
    if nl:
        out = out.reshape(u.shape)
        final_state = final_state.reshape(*lead, u.shape[nl], *final_state.shape[1:])
    return (out, final_state) if return_final_state else out


def _check_cu_seqlens(cu_seqlens, u, layout):
    """cu_seqlens as an int32 array, checked against u (batch 1, no leading dims); its values too
    when they are concrete (not traced)."""
    if not hasattr(cu_seqlens, "shape"):
        cu_seqlens = np.asarray(cu_seqlens)
    if u.ndim != 3 or u.shape[0] != 1:
        raise ValueError(
            f"cu_seqlens packs sequences along seqlen of one batch row: u must be (1, dim, seqlen) "
            f"(or (1, seqlen, dim)), got shape {tuple(u.shape)}"
        )
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1 or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise ValueError(
            f"cu_seqlens must be a rank-1 integer array (num_seqs + 1,), got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    seqlen = u.shape[2] if layout == "bdl" else u.shape[1]
    if not isinstance(cu_seqlens, jax.core.Tracer):
        v = np.asarray(cu_seqlens)
        if v[0] != 0 or v[-1] != seqlen or np.any(np.diff(v) < 0):
            raise ValueError(
                f"cu_seqlens must start at 0, never decrease and end at seqlen (= {seqlen}), got {v.tolist()}"
            )
    return jnp.asarray(cu_seqlens, jnp.int32)
