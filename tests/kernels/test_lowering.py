"""The lowering gate: with no GPU or TPU here, impl="pallas" must still lower and
export for "cuda" (Mosaic GPU kernel) and "tpu" (Mosaic TPU kernel).

What this proves (jax 0.10.2): the Pallas -> Mosaic GPU lowering runs in full on
CPU (layouts, WGMMA shapes, TMA transfers, shared-memory budget), so the cuda
export checks the hardware code path of gpu.py. For TPU, the Pallas -> Mosaic
lowering runs, but Mosaic's own passes (vector layouts, SMEM/VMEM budgets) run
in libtpu when XLA:TPU compiles the custom call: the *_tpu_compile tests run
that on this CPU with libtpu's deviceless compiler.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export

from pallas_kernels.ragged_paged_attention import make_kv_cache, ragged_paged_attention, write_kv

T, R, P = 64, 8, 6
MARKER = {"cuda": "mosaic_gpu", "tpu": "tpu_custom_call"}


def _specs(dtype, kv_heads, group, head_dim, page_size, num_pages=32):
    cache = make_kv_cache(num_pages, page_size, kv_heads, head_dim, dtype)
    i32 = jnp.int32
    return (jax.ShapeDtypeStruct((T, kv_heads * group, head_dim), dtype),
            jax.ShapeDtypeStruct(cache.shape, dtype), jax.ShapeDtypeStruct((R,), i32),
            jax.ShapeDtypeStruct((R, P), i32), jax.ShapeDtypeStruct((R + 1,), i32),
            jax.ShapeDtypeStruct((1,), i32))


def _export(platform, specs, **kw):
    fn = jax.jit(functools.partial(ragged_paged_attention, impl="pallas", sm_scale=0.1, **kw))
    return export.export(fn, platforms=[platform])(*specs).mlir_module()


SHAPES = [  # (kv_heads, group, head_dim, page_size)
    (8, 4, 128, 16),      # Qwen3-8B
    (4, 6, 256, 16),      # Qwen3.6-27B full attention
    (2, 1, 64, 32),
    (1, 8, 128, 128),
    (2, 2, 256, 256),
    (4, 2, 128, 64),
    (1, 4, 512, 16),      # Gemma 4 31B global layers on a 1x8 mesh
    (2, 8, 512, 64),
]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "k{}-g{}-h{}-s{}".format(*s))
def test_pallas_exports(platform, shape):
    text = _export(platform, _specs(jnp.bfloat16, *shape))
    assert MARKER[platform] in text


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_pallas_exports_window_and_soft_cap(platform):
    text = _export(platform, _specs(jnp.bfloat16, 2, 4, 128, 16), sliding_window=128,
                   soft_cap=30.0)
    assert MARKER[platform] in text


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("shape", [(2, 2, 256, 16), (1, 4, 512, 16)], ids=["sliding", "global"])
def test_pallas_exports_gemma4_windows(platform, shape):
    """Gemma 4 31B per-device (1x8) shapes with its windows (sliding layers: 1024)."""
    text = _export(platform, _specs(jnp.bfloat16, *shape), sliding_window=1024)
    assert MARKER[platform] in text


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("shape", [(2, 2, 256, 16), (4, 2, 128, 64)], ids=["gemma4", "h128"])
def test_pallas_exports_image_horizon(platform, shape):
    """Gemma 4's image mask (each token's horizon) in the kernels: the row horizons ride
    with the queries (a TMA into shared memory on cuda, a VMEM tile on tpu)."""
    specs = _specs(jnp.bfloat16, *shape) + (jax.ShapeDtypeStruct((T,), jnp.int32),)
    fn = jax.jit(lambda *a: ragged_paged_attention(*a[:6], horizon=a[6], impl="pallas",
                                                   sm_scale=0.1, sliding_window=1024))
    assert MARKER[platform] in export.export(fn, platforms=[platform])(*specs).mlir_module()


def test_float32_and_quantized_head_dim_512():
    """f32, and fp8 at head_dim 512, lower the TPU kernel; on cuda they take the XLA
    reference (WGMMA would run f32 as TF32; a quantized cache's cast needs 64-token KV
    steps, head_dim 512 has 32) -- and kv_cache_dtype_error says so."""
    from pallas_kernels.ragged_paged_attention import kv_cache_dtype_error
    for dtype, head_dim in ((jnp.float32, 128), (jnp.float8_e4m3fn, 512)):
        specs = _specs(dtype, 2, 2, head_dim, 16)
        if dtype != jnp.float32:      # a quantized cache takes its scales
            specs = specs + (jax.ShapeDtypeStruct((2, 2), jnp.float32),)
        fn = jax.jit(lambda *a: ragged_paged_attention(
            *a[:6], kv_scale=a[6] if len(a) > 6 else None, impl="pallas", sm_scale=0.1))
        assert "tpu_custom_call" in export.export(fn, platforms=["tpu"])(*specs).mlir_module()
        assert "mosaic_gpu" not in export.export(fn, platforms=["cuda"])(*specs).mlir_module()
        why = kv_cache_dtype_error(dtype, platform="gpu", backend="auto", head_dim=head_dim,
                                   num_heads=4, num_kv_heads=2, page_size=16)
        assert f"head_dim {head_dim}" in why or "float32" in why


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_write_kv_exports(platform):
    cache = make_kv_cache(32, 16, 8, 128, jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((T, 8, 128), jnp.bfloat16)
    fn = jax.jit(write_kv, donate_argnums=0)
    text = export.export(fn, platforms=[platform])(
        jax.ShapeDtypeStruct(cache.shape, cache.dtype), kv, kv,
        jax.ShapeDtypeStruct((T,), jnp.int32)).mlir_module()
    assert "scatter" in text
