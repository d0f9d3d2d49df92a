"""The model's device caches: the full-attention layers' paged KV (and Gemma 4's
sliding-window layers', with their own page count when the plan gives them a KV group)
and, for the linear-attention layers of hybrid models, the per-slot recurrent state,
each kind one array with its layers stacked (models/layer_stack.py).

Everything is allocated once, zeroed, in its sharding: KV caches split by KV
head, recurrent state by head group (models/gated_deltanet.py), so every device
holds only the heads it computes. `abstract_layer_caches` describes the same caches
without allocating them (shapes, dtypes and shardings), for compiling the engine's
programs ahead of time for a device that is not here.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from models.config import ModelConfig
from models.gated_deltanet import CONV_HEAD_AXIS, CONV_NDIM, STATE_HEAD_AXIS
from models.layer_stack import CONV, KV, KV_SLIDING, RECURRENT, cache_shapes
from pallas_kernels.ragged_paged_attention import KV_CACHE_NDIM, KV_HEAD_AXIS
from pallas_kernels.held_dtypes import held_dtype
from sharding import kv_cache_sharding
from sharding.parallel import heads_spec

logger = logging.getLogger("jaxserve")


def abstract_layer_caches(cfg: ModelConfig, mesh: Mesh, *, num_pages: int, page_size: int,
                          kv_dtype: Any, num_state_slots: int, conv_state_dtype: Any,
                          num_sliding_pages: int = 0) -> dict[str, jax.ShapeDtypeStruct]:
    """The stacked caches as ShapeDtypeStructs carrying their shardings; nothing is
    allocated. num_pages / num_sliding_pages (0: the sliding-window layers, if any, have
    num_pages too) / num_state_slots per layer; cfg.num_kv_heads is the number stored on
    this mesh (sharding.kv_head_layout)."""
    kv_sharding = kv_cache_sharding(mesh, KV_HEAD_AXIS, KV_CACHE_NDIM)
    shardings = {KV: kv_sharding, KV_SLIDING: kv_sharding,   # one page layout, split by head
                 CONV: NamedSharding(mesh, heads_spec(CONV_NDIM, CONV_HEAD_AXIS)),
                 RECURRENT: NamedSharding(mesh, heads_spec(4, STATE_HEAD_AXIS))}
    shapes = cache_shapes(cfg, num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype,
                          num_state_slots=num_state_slots, conv_state_dtype=conv_state_dtype,
                          num_sliding_pages=num_sliding_pages or None)
    return {kind: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[kind])
            for kind, s in shapes.items()}


def held_layer_caches(cfg: ModelConfig, mesh: Mesh, *, num_pages: int, page_size: int,
                      kv_dtype: Any, num_state_slots: int, conv_state_dtype: Any,
                      num_sliding_pages: int = 0) -> dict[str, jax.ShapeDtypeStruct]:
    """abstract_layer_caches as this platform holds them (_held): the arrays
    allocate_layer_caches makes, and what the programs are compiled for."""
    specs = abstract_layer_caches(cfg, mesh, num_pages=num_pages, page_size=page_size,
                                  kv_dtype=kv_dtype, num_state_slots=num_state_slots,
                                  conv_state_dtype=conv_state_dtype,
                                  num_sliding_pages=num_sliding_pages)
    return {kind: _held(kind, s, mesh) if kind in (KV, KV_SLIDING, CONV) else s
            for kind, s in specs.items()}


def cache_allocator(specs: dict[str, jax.ShapeDtypeStruct]
                    ) -> Callable[[], dict[str, jax.Array]]:
    """The compiled program that makes the caches held_layer_caches describes, zeroed, on
    their shardings (compiling it allocates nothing)."""
    shardings = {kind: s.sharding for kind, s in specs.items()}
    # One program makes them all (a jit per array would compile once per state shape).
    return jax.jit(lambda: {kind: jnp.zeros(s.shape, s.dtype) for kind, s in specs.items()},
                   out_shardings=shardings).lower().compile()


def allocate_layer_caches(specs: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """The caches held_layer_caches describes, zeroed, on their shardings."""
    return cache_allocator(specs)()


def make_layer_caches(cfg: ModelConfig, mesh: Mesh, *, num_pages: int, page_size: int,
                      kv_dtype: Any, num_state_slots: int, conv_state_dtype: Any,
                      num_sliding_pages: int = 0
                      ) -> tuple[dict[str, jax.Array], dict[str, Any]]:
    """(caches, their shardings), allocated as held_layer_caches describes them."""
    specs = held_layer_caches(cfg, mesh, num_pages=num_pages, page_size=page_size,
                              kv_dtype=kv_dtype, num_state_slots=num_state_slots,
                              conv_state_dtype=conv_state_dtype,
                              num_sliding_pages=num_sliding_pages)
    return allocate_layer_caches(specs), {kind: s.sharding for kind, s in specs.items()}


def _held(kind: str, spec: jax.ShapeDtypeStruct, mesh: Mesh) -> jax.ShapeDtypeStruct:
    """A cache as the platform holds it (on CPU a narrow float KV cache or conv state as
    its bits: pallas_kernels/held_dtypes.py says why), logged when it differs."""
    platform = mesh.devices.flat[0].platform
    held = held_dtype(spec.dtype, platform)
    if held != spec.dtype:
        logger.info("%s cache: %s values held as %s bit patterns on CPU (XLA:CPU updates "
                    "integer arrays in place, narrow float ones through whole-array "
                    "converts)", kind, jnp.dtype(spec.dtype).name, held.name)
    elif platform == "cpu" and jnp.dtype(spec.dtype) == jnp.float8_e5m2:
        logger.warning("%s cache float8_e5m2 on CPU: XLA:CPU converts the whole cache on "
                       "every write (several times slower than fp8 e4m3, "
                       "--kv-cache-dtype fp8)", kind)
    return jax.ShapeDtypeStruct(spec.shape, held, sharding=spec.sharding)
