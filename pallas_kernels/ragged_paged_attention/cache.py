"""The paged KV cache: its layout, how to build it and how to write new tokens.

Layout: [num_pages, 2K, S, H] (a model stacks its layers' pages in one such array,
models/layer_stack.py; to the kernels it is one big cache), entry 2k of axis 1 the K
rows and 2k + 1 the V rows of kv head k (the bytes of [num_pages, K, 2, S, H]).
Each (page, kv head) holds its K and V rows as two contiguous [S, H] tiles, so
the kernels fetch one page of one head with two rectangular copies (a TMA box
on Hopper, one DMA on TPU) and the [S, H] minor dims tile cleanly on TPU.
K and V share one axis on purpose: with a separate size-K axis, a device that
holds one kv head has a size-1 axis, for which XLA:TPU lays the cache out
differently for the write scatter than for the kernels and copies the whole
cache twice per layer and step (seen in the compiled HLO). Page 0 is the null
page that padding tokens write to. KV_HEAD_AXIS names the axis to shard for
tensor parallelism: a device gets whole (K, V) pairs since 2K / M = 2 (K / M).

Glossary: K kv heads, S page size, H head dim, N tokens written.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from pallas_kernels.held_dtypes import as_held, value_dtype
from pallas_kernels.ragged_paged_attention.quant import is_quantized, quantize

KV_HEAD_AXIS = 1
KV_CACHE_NDIM = 4

def make_kv_cache(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                  dtype: DTypeLike = jnp.bfloat16) -> jax.Array:
    for name, value in (("num_pages", num_pages), ("page_size", page_size),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    shape = (num_pages, 2 * num_kv_heads, page_size, head_dim)
    assert len(shape) == KV_CACHE_NDIM
    return jnp.zeros(shape, dtype)


def cache_dims(cache: jax.Array) -> tuple[int, int, int, int]:
    """(num_pages, page_size, num_kv_heads, head_dim) of a cache from make_kv_cache."""
    if cache.ndim != 4 or cache.shape[1] % 2:
        raise ValueError(f"cache shape {cache.shape}: expected [num_pages, 2K, S, H] "
                         f"from make_kv_cache")
    num_pages, kv2, page_size, head_dim = cache.shape
    return num_pages, page_size, kv2 // 2, head_dim


def check_kv_scale(cache: jax.Array, kv_scale: jax.Array | None) -> None:
    """A quantized cache needs its float32[K, 2] scales; a float cache takes none (a
    scale given for it would be silently ignored)."""
    _, _, kv_heads, _ = cache_dims(cache)
    if not is_quantized(value_dtype(cache.dtype)):
        if kv_scale is not None:
            raise ValueError(f"kv_scale given for a {jnp.dtype(cache.dtype)} cache: only "
                             f"quantized (fp8 / int8) caches take scales")
        return
    if kv_scale is None:
        raise ValueError(f"a {jnp.dtype(cache.dtype)} cache needs kv_scale float32[{kv_heads}, 2] "
                         f"(the K and V scale of each kv head)")
    if kv_scale.shape != (kv_heads, 2):
        raise ValueError(f"kv_scale shape {kv_scale.shape}: expected ({kv_heads}, 2)")


def write_kv(cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
             kv_scale: jax.Array | None = None) -> jax.Array:
    """Scatter k, v [N, K, H] into their slots (page * page_size + offset).

    A quantized cache (quant.py) stores k / kv_scale[:, 0] and v / kv_scale[:, 1]
    of each kv head; kv_scale is required for it and refused for a float cache.

    One XLA scatter of [H] rows into the cache seen as [P * 2K * S, H] (the same
    bytes): under jit with the cache donated it updates the buffer in place
    (tests/kernels/test_write_kv.py checks the compiled engine step). Scattering
    [2K, H] slices into the 4-D cache instead lets XLA:TPU prefer another layout
    for the scatter at large token counts (2048) and copy the whole cache there
    and back around it (tests/sharding/test_forward_tpu_hlo.py). Slots outside
    the cache are dropped.
    """
    num_pages, page_size, kv_heads, head_dim = cache_dims(cache)
    check_kv_scale(cache, kv_scale)
    if k.shape != v.shape or k.shape[1:] != (kv_heads, head_dim):
        raise ValueError(f"k {k.shape} / v {v.shape}: expected [N, {kv_heads}, {head_dim}]")
    slot_mapping = slot_mapping.astype(jnp.int32)
    page = slot_mapping // page_size
    offset = slot_mapping % page_size
    page = jnp.where(slot_mapping < 0, num_pages, page)      # negative slots are dropped too
    kv = jnp.stack([k, v], axis=2)                          # [N, K, 2, H]
    if kv_scale is not None:
        kv = quantize(kv, kv_scale.astype(jnp.float32)[:, :, None], value_dtype(cache.dtype))
    kv = as_held(kv, cache.dtype)
    kv = kv.reshape(k.shape[0] * 2 * kv_heads, head_dim)    # [N * 2K, H]
    # Rows of the cache seen as [P * 2K * S, H]: row (page * 2K + j) * S + offset.
    rows = ((page[:, None] * (2 * kv_heads) + jnp.arange(2 * kv_heads)) * page_size
            + offset[:, None]).reshape(-1)
    flat = cache.reshape(num_pages * 2 * kv_heads * page_size, head_dim)
    return flat.at[rows].set(kv, mode="drop").reshape(cache.shape)
