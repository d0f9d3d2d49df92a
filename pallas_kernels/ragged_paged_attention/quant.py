"""Quantized KV caches: fp8 (e4m3, e5m2) and int8 with static per-(kv head) scales.

A layer's scales are kv_scale float32[K, 2]: [k, 0] scales the K rows of kv head
k, [k, 1] its V rows, so kv_scale.reshape(2K) lines up with the cache's axis 1
(and shards over the model axis like it). Stored value = x / scale, rounded;
dequantized value = stored * scale. The scales are static and per head so they
fold out of the kernels (dispatch.py): q . (s_k k) = (s_k q) . k and
sum_j p_j (s_v v_j) = s_v sum_j p_j v_j, so a kernel only reads a narrow
cache and casts its tiles to the compute dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from pallas_kernels.kv_cache_dtypes import KV_QUANT_DTYPE_NAMES

# Cache dtype names (an engine's kv_cache_dtype) -> the stored dtype.
KV_QUANT_DTYPES = {name: jnp.dtype(stored) for name, stored in KV_QUANT_DTYPE_NAMES.items()}
_QUANTIZED = frozenset(jnp.dtype(d) for d in KV_QUANT_DTYPES.values())
INT8_MAX = 127      # symmetric: -128 is never stored, so negation stays exact


def is_quantized(dtype: DTypeLike) -> bool:
    """True for the one-byte cache dtypes that need kv_scale (fp8 e4m3 / e5m2, int8)."""
    return jnp.dtype(dtype) in _QUANTIZED


def _check(dtype):
    if not is_quantized(dtype):
        raise ValueError(f"dtype {jnp.dtype(dtype)}: expected one of "
                         f"{sorted(str(d) for d in _QUANTIZED)}")


def quantize(x: jax.Array, scale: jax.Array, dtype: DTypeLike) -> jax.Array:
    """x / scale stored as dtype (scale broadcasts against x). Out-of-range values
    clip to the largest finite value: float8_e4m3fn has no inf, so an overflowing
    cast would give NaN; int8 rounds to nearest even and clips to [-127, 127]."""
    _check(dtype)
    y = x.astype(jnp.float32) / scale
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.clip(jnp.round(y), -INT8_MAX, INT8_MAX).astype(dtype)
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(y, -top, top).astype(dtype)


def dequantize(x_q: jax.Array, scale: jax.Array, dtype: DTypeLike = jnp.float32) -> jax.Array:
    """x_q * scale (computed in float32) as dtype."""
    _check(x_q.dtype)
    return (x_q.astype(jnp.float32) * scale).astype(dtype)
