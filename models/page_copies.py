"""Whole pages and state slots read out of, and written back into, the stacked caches
(the host tier of the prefix cache: jaxserve/runner/host_tier.py).

A page id p names one page in every layer of a KV array: rows d * pages + p of the
array [A * pages, 2K, S, H] (models/layer_stack.py); a state slot s likewise names rows
d * slots + s of the conv and recurrent arrays. `gather_pages` reads those rows for a
fixed number of ids, `scatter_pages` writes them back, id-major: entry b * A + d is id
b's row in layer d, so a host pool holds an id's rows as one [A, ...] block.

Shapes are fixed per call (the caller pads with id 0: the null page / null slot, which
padding tokens already write junk into, so writing junk there is harmless), and
scatter_pages only ever touches the rows it names: under jit with the caches donated
it updates them in place (tests/runner/test_host_tier_tpu_compile.py checks the TPU
compile: no temporary the size of a cache). The rows keep the cache's dtype as held
(pallas_kernels/held_dtypes.py: bits on CPU) and its layout, so a quantized cache's
pages travel as stored; its scales are per layer and head, not per page.
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp


def page_rows(ids: jax.Array, layers: int, per_layer: int) -> jax.Array:
    """int32[B * layers]: the rows of ids [B] in every layer, id-major."""
    ids = ids.astype(jnp.int32)
    return (ids[:, None] + per_layer * jnp.arange(layers, dtype=jnp.int32)).reshape(-1)


def gather_pages(caches: Mapping[str, jax.Array], ids: Mapping[str, jax.Array],
                 layers: Mapping[str, int]) -> dict[str, jax.Array]:
    """For each kind in `ids`: its rows of ids[kind] in each of its layers[kind]
    layers, [B * A, *row] id-major."""
    out = {}
    for kind, kind_ids in ids.items():
        cache = caches[kind]
        out[kind] = cache[page_rows(kind_ids, layers[kind], cache.shape[0] // layers[kind])]
    return out


def scatter_pages(caches: Mapping[str, jax.Array], ids: Mapping[str, jax.Array],
                  values: Mapping[str, jax.Array], layers: Mapping[str, int]
                  ) -> dict[str, jax.Array]:
    """caches with the rows gather_pages would read for `ids` set to `values`; kinds
    not in `ids` are returned as they are. Repeated ids (padding) write one of their
    values, unspecified which."""
    out = dict(caches)
    for kind, kind_ids in ids.items():
        cache = caches[kind]
        rows = page_rows(kind_ids, layers[kind], cache.shape[0] // layers[kind])
        vals = values[kind]
        if vals.shape != (rows.shape[0], *cache.shape[1:]):
            raise ValueError(f"{kind}: values {vals.shape}, expected "
                             f"{(rows.shape[0], *cache.shape[1:])}")
        out[kind] = cache.at[rows].set(vals.astype(cache.dtype))
    return out
