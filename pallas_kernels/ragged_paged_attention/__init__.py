"""Ragged paged attention: decodes, prefills and prefix-cached chunks in one call.

The cache layout is owned by this module: build caches with `make_kv_cache`,
fill them with `write_kv`, read them with `ragged_paged_attention`.
"""
from pallas_kernels.ragged_paged_attention.reference import (
    make_kv_cache,
    ragged_paged_attention,
    write_kv,
)

__all__ = ["make_kv_cache", "write_kv", "ragged_paged_attention"]
