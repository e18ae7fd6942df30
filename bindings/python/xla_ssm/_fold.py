"""The vmap rule both scans share: one call for a whole jax.vmap, the mapped axis folded into an
existing axis of every operand and unfolded from every result."""

from __future__ import annotations

import jax.numpy as jnp


def fold_vmap(f, k, roles, out_roles, ops, in_batched, per_example, forward, axis_of):
    """Calls `f` once for k mapped examples. A forward whose parameters (roles not in `per_example`)
    are all unmapped folds k into axis 0 (batch: a free reshape, the parameters stay as they are);
    otherwise every operand folds k into `axis_of(role)`, unmapped ones broadcast first, so each
    example keeps its own copy of the parameters and the backward's sums over them stay per example.
    Returns the results with k leading, and that all of them are mapped."""
    params_mapped = any(b for r, b in zip(roles, in_batched) if r not in per_example)
    into_batch = forward and not params_mapped

    def axis(role):
        return 0 if into_batch else axis_of(role)

    folded = []
    for role, x, b in zip(roles, ops, in_batched):
        if into_batch and role not in per_example:
            folded.append(x)  # a shared parameter stays as it is
            continue
        if not b:
            x = jnp.broadcast_to(x, (k, *x.shape))
        ax = axis(role)
        x = jnp.moveaxis(x, 0, ax)
        folded.append(x.reshape(*x.shape[:ax], k * x.shape[ax + 1], *x.shape[ax + 2 :]))
    res = f(*folded)  # f again: an outer vmap folds its axis the same way
    out = []
    for role, y in zip(out_roles, res):
        ax = axis(role)
        y = y.reshape(*y.shape[:ax], k, y.shape[ax] // k if k else 0, *y.shape[ax + 1 :])
        out.append(jnp.moveaxis(y, ax, 0))
    return tuple(out), (True,) * len(out)
