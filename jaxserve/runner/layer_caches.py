"""Each layer's device cache: a paged KV cache (full attention) or, for the
linear-attention layers of hybrid models, the per-slot recurrent state.

Everything is allocated once, zeroed, in its sharding: KV caches split by KV
head, recurrent state by head group (models/gated_deltanet.py), so every device
holds only the heads it computes.
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


def make_layer_caches(cfg: ModelConfig, mesh: Mesh, *, num_pages: int, page_size: int,
                      kv_dtype: Any, num_state_slots: int, conv_state_dtype: Any
                      ) -> tuple[list[Any], list[Any]]:
    """(caches, their shardings), one entry per layer. cfg.num_kv_heads is the number
    stored on this mesh (sharding.kv_head_layout)."""
    kv_sharding = kv_cache_sharding(mesh, KV_HEAD_AXIS, KV_CACHE_NDIM)
    new_kv = jax.jit(lambda: make_kv_cache(num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                                           kv_dtype), out_shardings=kv_sharding)
    state_sharding = (NamedSharding(mesh, heads_spec(4, CONV_HEAD_AXIS)),
                      NamedSharding(mesh, heads_spec(4, STATE_HEAD_AXIS)))
    caches, shardings = [], []
    for i in range(cfg.num_layers):
        if cfg.layer_type(i) == LINEAR_ATTENTION:
            specs = state_shapes(cfg, num_state_slots, conv_state_dtype)
            caches.append(tuple(
                jax.jit(lambda s=s: jnp.zeros(s.shape, s.dtype), out_shardings=sh)()
                for s, sh in zip(specs, state_sharding)))
            shardings.append(state_sharding)
        else:
            caches.append(new_kv())
            shardings.append(kv_sharding)
    return caches, shardings
