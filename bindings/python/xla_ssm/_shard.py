"""The sharding rule both scans share (custom_partitioning): a plan read off the operands' shardings
says which mesh axes shard what; each operand is resharded to, and each result has, its role's spec
under that plan; the FFI call runs on the shards, and the backward psums the gradients that are
partial sums. Each op supplies the plan, the specs, the psums and its Shardy factors."""

from __future__ import annotations

import math
import re

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding


def axes(entry):
    """A PartitionSpec entry as a tuple of mesh axis names (() when unsharded)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def shard_axes(mesh, x, channel_axis, groups):
    """(batch axes, channel axes, group axes): the mesh axes that shard x's axis 0 (batch) and its
    `channel_axis` (channels, read by B/C's `groups` groups; 0: B/C has none). Every other axis
    stays whole (the scans run or sum along them). Batch and channels split only where they divide
    evenly, and channels only into whole groups (channel c reads group c // (channels // groups)).
    The groups split like the channels; with one group, every channel shard reads all of B/C."""
    spec = tuple(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else ()
    spec += (None,) * (len(x.shape) - len(spec))
    bax, cax = axes(spec[0]), axes(spec[channel_axis])
    size = lambda names: math.prod(mesh.shape[a] for a in names)  # noqa: E731
    if x.shape[0] % size(bax):
        bax = ()
    if x.shape[channel_axis] % size(cax) or (groups > 1 and groups % size(cax)):
        cax = ()
    return bax, cax, cax if groups > 1 else ()


def seq_axes(mesh, x, seq_axis, seqlen, checkpoint_len):
    """The mesh axes that shard x's `seq_axis` (seqlen), where the scan can run on the shards: they
    divide seqlen evenly, into whole checkpoint intervals when the call has checkpoints. Else ()
    (the sequence is then gathered)."""
    spec = tuple(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else ()
    spec += (None,) * (len(x.shape) - len(spec))
    names = axes(spec[seq_axis])
    shards = math.prod(mesh.shape[a] for a in names)
    if shards <= 1 or seqlen % shards or (checkpoint_len and (seqlen // shards) % checkpoint_len):
        return ()
    return names


def partitioned(raw, in_roles, out_roles, plan, spec, psum_axes, factors, replicated, sharded_lower=None, sizes=None):
    """custom_partitioning of `raw(call, *ops)`, `call` static (a hashable with .kind "fwd"/"bwd"):
    plan(call, mesh, arg_shapes)  which mesh axes shard what (any value the next two understand);
    spec(call, role, plan)        the PartitionSpec of an operand / result of that role;
    psum_axes(call, role, plan)   the mesh axes a backward result of that role is a partial sum over;
    factors(call, role, shape)    Shardy's factor letters for that role ("b l h p"; "(k r)": a dim
                                  that is factor k times factor r);
    replicated                    the letters never sharded (the axes a scan runs or sums along);
    sharded_lower(call, plan, mesh)  None, or the per-shard function of a call whose plan shards an
                                  axis the scan runs along (it communicates itself; the psums follow);
    sizes(call)                   sizes of factors used only inside compound dims ({"r": 32}).
    """

    def shardings(call, mesh, arg_shapes):
        p = plan(call, mesh, arg_shapes)
        ins = tuple(NamedSharding(mesh, spec(call, r, p)) for r in in_roles(call))
        outs = tuple(NamedSharding(mesh, spec(call, r, p)) for r in out_roles(call))
        return p, ins, outs

    def infer(call, mesh, arg_shapes, result_shape):
        return shardings(call, mesh, arg_shapes)[2]

    def partition(call, mesh, arg_shapes, result_shape):
        p, ins, outs = shardings(call, mesh, arg_shapes)

        per_shard = sharded_lower(call, p, mesh) if sharded_lower else None

        def lower(*ops):
            res = per_shard(*ops) if per_shard else raw(call, *ops)
            if call.kind == "fwd":  # every result is per shard: no communication
                return res
            out = []
            for role, g in zip(out_roles(call), res):
                over = psum_axes(call, role, p)
                out.append(jax.lax.psum(g, over) if over else g)
            return tuple(out)

        return mesh, lower, outs, ins

    def sharding_rule(call, mesh, operand_types, result_types):
        """Shardy's einsum-like rule: the sharded factors pass through, `replicated` ones may not be sharded."""

        def side(roles, types):
            return ", ".join(factors(call, r, tuple(t.shape)) for r, t in zip(roles, types))

        lhs, rhs = side(in_roles(call), operand_types), side(out_roles(call), result_types)
        letters = re.findall(r"\w+", f"{lhs} {rhs}")
        # Shardy numbers the factors in order of first appearance and wants these in that order
        # (which depends on the optional operands present, e.g. packed states before or after cu).
        first = {f: letters.index(f) for f in set(letters)}
        need = tuple(sorted((f for f in replicated if f in first), key=first.__getitem__))
        extra = {f: n for f, n in (sizes(call) if sizes else {}).items() if f in first}
        return f"{lhs} -> {rhs}", {"need_replication_factors": need, **extra}

    f = custom_partitioning(raw, static_argnums=(0,))
    f.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=sharding_rule)
    return f
