"""The sharding rule both scans share (custom_partitioning): a plan read off the operands' shardings
says which mesh axes shard what; each operand is resharded to, and each result has, its role's spec
under that plan; the FFI call runs on the shards, and the backward psums the gradients that are
partial sums. Each op supplies the plan, the specs, the psums and its Shardy factors."""

from __future__ import annotations

import math

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


def partitioned(raw, in_roles, out_roles, plan, spec, psum_axes, factors, replicated):
    """custom_partitioning of `raw(call, *ops)`, `call` static (a hashable with .kind "fwd"/"bwd"):
    plan(call, mesh, arg_shapes)  which mesh axes shard what (any value the next two understand);
    spec(call, role, plan)        the PartitionSpec of an operand / result of that role;
    psum_axes(call, role, plan)   the mesh axes a backward result of that role is a partial sum over;
    factors(call, role, ndim)     Shardy's factor letters for that role ("b l h p");
    replicated                    the letters never sharded (the axes a scan runs or sums along).
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

        def lower(*ops):
            res = raw(call, *ops)
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
            return ", ".join(factors(call, r, len(t.shape)) for r, t in zip(roles, types))

        lhs, rhs = side(in_roles(call), operand_types), side(out_roles(call), result_types)
        letters = f"{lhs} {rhs}".replace(",", " ").split()
        # Shardy numbers the factors in order of first appearance and wants these in that order
        # (which depends on the optional operands present, e.g. packed states before or after cu).
        first = {f: letters.index(f) for f in set(letters)}
        need = tuple(sorted((f for f in replicated if f in first), key=first.__getitem__))
        return f"{lhs} -> {rhs}", {"need_replication_factors": need}

    f = custom_partitioning(raw, static_argnums=(0,))
    f.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=sharding_rule)
    return f
