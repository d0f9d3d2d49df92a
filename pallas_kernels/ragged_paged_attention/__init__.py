"""Ragged paged attention: decodes, prefills and prefix-cached chunks in one call.

The cache layout is owned by this module: build caches with `make_kv_cache`,
fill them with `write_kv`, read them with `ragged_paged_attention`
(impl="pallas" picks the Mosaic GPU or Mosaic TPU kernel by the lowering
platform, impl="reference" the pure-jnp spec; see dispatch.py). A quantized
cache (fp8 / int8, quant.py) comes with per-kv-head scales, kv_scale, passed
to both write_kv and ragged_paged_attention.
"""
from pallas_kernels.ragged_paged_attention.cache import (KV_CACHE_NDIM, KV_HEAD_AXIS,
                                                         make_kv_cache, write_kv)
from pallas_kernels.ragged_paged_attention.dispatch import (backend_options, kv_cache_dtype_error,
                                                             ragged_paged_attention, resolve_backend)
from pallas_kernels.ragged_paged_attention.quant import (KV_QUANT_DTYPES, dequantize, is_quantized,
                                                         quantize)

__all__ = ["make_kv_cache", "write_kv", "ragged_paged_attention", "backend_options", "resolve_backend",
           "kv_cache_dtype_error", "KV_HEAD_AXIS", "KV_CACHE_NDIM", "KV_QUANT_DTYPES",
           "is_quantized", "quantize", "dequantize"]
