"""Copies between recurrent-state slots, inside the jitted step (prefix caching of hybrids).

A hybrid's cached prefix is a snapshot slot: a copy of some request's linear-attention
state at a page boundary. A prefix hit restores a snapshot into the new request's slot
before the forward; a snapshot is saved from a request's slot after it. Either is a
list of (src, dst) slot pairs, each copied in every linear-attention layer of both state
arrays (models/layer_stack.py: layer d's slot s is row d * slots + s).

Shapes are fixed: a step carries K pairs and a count of the real ones, and a loop runs
`count` iterations, so padding pairs cost nothing and nothing recompiles. Each
iteration moves one row per layer and array with dynamic_slice / dynamic_update_slice on
the leading (unsharded) axis: a donated cache is updated in place, the only temporary
is one row, and each device copies its own heads.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from models.layer_stack import CONV, RECURRENT


def copy_state_slots(caches: dict[str, Any], pairs: jax.Array, count: jax.Array,
                     num_slots: int) -> dict[str, Any]:
    """caches with slot pairs[i, 0] copied to slot pairs[i, 1] in every linear-attention
    layer, for i < count, in order (a chain a->b, b->c moves a's state to c).
    pairs: int32[K, 2]; count: int32 scalar or [1] (clamped to K); num_slots: slots per
    layer, null slot included. Other caches ("kv", ...) are returned as they are."""
    if CONV not in caches:
        return caches
    layers = caches[RECURRENT].shape[0] // num_slots
    n = jnp.minimum(jnp.reshape(count, ()), pairs.shape[0])

    def copy_pair(i: jax.Array, state: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        src, dst = pairs[i, 0], pairs[i, 1]
        out = []
        for x in state:
            # Layers unrolled: their rows are independent, and one loop iteration per
            # pair (not per pair and layer) keeps the loop's overhead per pair.
            for d in range(layers):
                row = jax.lax.dynamic_slice_in_dim(x, d * num_slots + src, 1)
                x = jax.lax.dynamic_update_slice_in_dim(x, row, d * num_slots + dst, 0)
            out.append(x)
        return tuple(out)

    conv, rec = jax.lax.fori_loop(0, n, copy_pair, (caches[CONV], caches[RECURRENT]))
    return {**caches, CONV: conv, RECURRENT: rec}
