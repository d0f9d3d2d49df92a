"""Each layer's device cache: a paged KV cache (full attention) or, for the
linear-attention layers of hybrid models, the per-slot recurrent state.

Everything is allocated once, zeroed, in its sharding: KV caches split by KV
head, recurrent state by head group (models/gated_deltanet.py), so every device
holds only the heads it computes. `layer_cache_specs` describes the same caches
without allocating them (shapes, dtypes and shardings), for compiling the engine's
programs ahead of time for a device that is not here.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from models.config import LINEAR_ATTENTION, ModelConfig
from models.gated_deltanet import CONV_HEAD_AXIS, STATE_HEAD_AXIS, state_shapes
from pallas_kernels.ragged_paged_attention import KV_CACHE_NDIM, KV_HEAD_AXIS, make_kv_cache
from sharding import kv_cache_sharding
from sharding.parallel import heads_spec


def layer_cache_specs(cfg: ModelConfig, mesh: Mesh, *, num_pages: int, page_size: int,
                      kv_dtype: Any, num_state_slots: int, conv_state_dtype: Any) -> list[Any]:
    """One entry per layer: the KV cache's ShapeDtypeStruct, or the (conv, recurrent)
    state's, each carrying its sharding. Nothing is allocated. cfg.num_kv_heads is the
    number stored on this mesh (sharding.kv_head_layout)."""
    # The KV layout belongs to the kernel module: ask make_kv_cache for its shape.
    kv = jax.eval_shape(lambda: make_kv_cache(num_pages, page_size, cfg.num_kv_heads,
                                              cfg.head_dim, kv_dtype))
    kv = jax.ShapeDtypeStruct(kv.shape, kv.dtype,
                              sharding=kv_cache_sharding(mesh, KV_HEAD_AXIS, KV_CACHE_NDIM))
    state_sharding = (NamedSharding(mesh, heads_spec(4, CONV_HEAD_AXIS)),
                      NamedSharding(mesh, heads_spec(4, STATE_HEAD_AXIS)))
    specs: list[Any] = []
    for i in range(cfg.num_layers):
        if cfg.layer_type(i) == LINEAR_ATTENTION:
            specs.append(tuple(jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh) for s, sh in
                               zip(state_shapes(cfg, num_state_slots, conv_state_dtype),
                                   state_sharding)))
        else:
            specs.append(kv)
    return specs


def make_layer_caches(cfg: ModelConfig, mesh: Mesh, *, num_pages: int, page_size: int,
                      kv_dtype: Any, num_state_slots: int, conv_state_dtype: Any
                      ) -> tuple[list[Any], list[Any]]:
    """(caches, their shardings), one entry per layer, allocated as layer_cache_specs
    describes them."""
    specs = layer_cache_specs(cfg, mesh, num_pages=num_pages, page_size=page_size,
                              kv_dtype=kv_dtype, num_state_slots=num_state_slots,
                              conv_state_dtype=conv_state_dtype)
    shardings = jax.tree_util.tree_map(lambda s: s.sharding, specs)
    # One program makes them all (a jit per array would compile once per state shape).
    caches = jax.jit(lambda: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), specs),
                     out_shardings=shardings)()
    return caches, shardings
