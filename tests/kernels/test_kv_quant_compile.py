"""Quantized KV caches compiled for TPU (libtpu's deviceless XLA:TPU + Mosaic) and
lowered for cuda (Mosaic GPU), on this CPU machine.

TPU: the kernel compiles with fp8 (e4m3, e5m2) and int8 caches on v5e and v6e, at
a production decode shape (Qwen3-8B, 256 rows at 262,144 tokens; e5m2 on the small
shape only) and a small mixed one; fp8 compiles on v5e too, which has no fp8
arithmetic (the kernel casts tiles to bf16 in VMEM). The kernel reads the cache as
stored: no cache-sized convert or copy runs before it. write_kv followed by the
kernel, the cache donated (one layer of the engine's step), updates the quantized
cache in place.
cuda: the Mosaic GPU kernel lowers for fp8 and int8 caches (cast in shared memory
before the WGMMAs); where it cannot (odd page sizes) the reference runs.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

from pallas_kernels.ragged_paged_attention import ragged_paged_attention, write_kv
from tests.tpu_compile import compile_on_tpu, hlo_lines

CONTEXT = 262_144
SHAPES = {  # name: (T, R, pages per request, kv heads, group, head_dim, page size, pages)
    "small-mixed-g8": (64, 8, 6, 1, 8, 128, 128, 32),
    "qwen3-8b-decode-256": (256, 256, CONTEXT // 16, 8, 4, 128, 16, 4096),
}
HLO_DTYPE = {jnp.dtype(jnp.float8_e4m3fn): "f8e4m3fn", jnp.dtype(jnp.float8_e5m2): "f8e5m2",
             jnp.dtype(jnp.int8): "s8"}


def _args(t, r, p, k, g, h, s, n, dtype):
    i32 = jnp.int32
    return (jax.ShapeDtypeStruct((t, k * g, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, 2 * k, s, h), dtype),
            jax.ShapeDtypeStruct((r,), i32), jax.ShapeDtypeStruct((r, p), i32),
            jax.ShapeDtypeStruct((r + 1,), i32), jax.ShapeDtypeStruct((1,), i32),
            jax.ShapeDtypeStruct((k, 2), jnp.float32))


def _attend(q, cache, kv_lens, table, qsl, num_seqs, kv_scale, **kw):
    return ragged_paged_attention(q, cache, kv_lens, table, qsl, num_seqs, kv_scale=kv_scale,
                                  sm_scale=0.1, **kw)


def _cache_lines(hlo: str, cache_shape, dtype) -> list[str]:
    """Instructions whose result has the cache's shape and dtype."""
    text = "{}[{}]".format(HLO_DTYPE[jnp.dtype(dtype)], ",".join(map(str, cache_shape)))
    return [ln for ln in hlo_lines(hlo) if re.search(r"= " + re.escape(text) + r"\{", ln)]


TARGET_DTYPES = {"v6e-e4m3": ("tpu-v6e", jnp.float8_e4m3fn), "v6e-e5m2": ("tpu-v6e", jnp.float8_e5m2),
                 "v6e-int8": ("tpu-v6e", jnp.int8), "v5e-int8": ("tpu-v5e", jnp.int8),
                 "v5e-e4m3": ("tpu-v5e", jnp.float8_e4m3fn)}
# Every chip and cache dtype on the small shape; the production one leaves out e5m2 (an
# fp8 cache read as e4m3's is, on v6e and on v5e).
CASES = [(shape, name) for shape in SHAPES for name in TARGET_DTYPES
         if not (shape == "qwen3-8b-decode-256" and name == "v6e-e5m2")]


@pytest.mark.parametrize("shape, name", CASES, ids=[f"{s}-{n}" for s, n in CASES])
def test_kernel_compiles_for_tpu_reading_the_narrow_cache(shape, name):
    target, dtype = TARGET_DTYPES[name]
    args = _args(*SHAPES[shape], dtype)
    compiled = compile_on_tpu(functools.partial(_attend, impl="pallas"), *args, target=target)
    hlo = compiled.as_text()
    kernel = [ln for ln in hlo_lines(hlo) if 'custom_call_target="tpu_custom_call"' in ln]
    assert len(kernel) == 1
    narrow = "{}[{}]".format(HLO_DTYPE[jnp.dtype(dtype)], ",".join(map(str, args[1].shape)))
    assert narrow in kernel[0]                       # the kernel's operand is the stored cache
    # Nothing converts the cache first, nor copies it in HBM (a small one may be
    # prefetched to on-chip memory, S(1), which is how XLA:TPU treats any small input).
    dims = ",".join(map(str, args[1].shape))
    assert not re.search(r"= (bf16|f16|f32)\[{}\]".format(dims), hlo)
    made = [ln for ln in _cache_lines(hlo, args[1].shape, dtype)
            if " parameter(" not in ln and "S(1)}" not in ln]
    assert not made, made


@pytest.mark.parametrize("target,dtype", [("tpu-v6e", jnp.float8_e4m3fn), ("tpu-v5e", jnp.int8)],
                         ids=["v6e-e4m3", "v5e-int8"])
def test_write_then_attend_updates_the_quantized_cache_in_place(target, dtype):
    """One layer of the engine's step at a prefill-sized bucket (2048 tokens, where the
    scatter's preferred layout once differed from the kernel's): the donated cache
    aliases the output, no cache-sized buffer is made, and the write quantizes."""
    t, r, p, k, g, h, s, n = 2048, 16, CONTEXT // 16, 8, 4, 128, 16, 4096
    q, cache, kv_lens, table, qsl, num_seqs, kv_scale = _args(t, r, p, k, g, h, s, n, dtype)
    kv = jax.ShapeDtypeStruct((t, k, h), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((t,), jnp.int32)

    def layer(cache, k_new, v_new, slots, q, kv_lens, table, qsl, num_seqs, kv_scale):
        cache = write_kv(cache, k_new, v_new, slots, kv_scale)
        return _attend(q, cache, kv_lens, table, qsl, num_seqs, kv_scale, impl="pallas"), cache

    compiled = compile_on_tpu(layer, cache, kv, kv, slots, q, kv_lens, table, qsl, num_seqs,
                              kv_scale, target=target, donate_argnums=(0,))
    hlo = compiled.as_text()
    assert re.search(r"input_output_alias=\{ \{1\}: \(0, \{\}, may-alias\) \}", hlo.splitlines()[0])
    assert not [ln for ln in _cache_lines(hlo, cache.shape, dtype) if re.search(r" copy\(", ln)]
    assert compiled.memory_analysis().temp_size_in_bytes < cache.size * cache.dtype.itemsize // 2
    assert "scatter" in hlo and "tpu_custom_call" in hlo


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8],
                         ids=["e4m3", "e5m2", "int8"])
@pytest.mark.parametrize("shape", [(8, 4, 128, 16), (4, 6, 256, 16), (2, 1, 64, 32)],
                         ids=lambda s: "k{}-g{}-h{}-s{}".format(*s))
def test_gpu_kernel_lowers_for_cuda(shape, dtype):
    k, g, h, s = shape
    args = _args(64, 8, 6, k, g, h, s, 32, dtype)
    fn = jax.jit(functools.partial(_attend, impl="pallas"))
    assert "mosaic_gpu" in export.export(fn, platforms=["cuda"])(*args).mlir_module()


def test_gpu_odd_page_size_takes_the_reference():
    """KV steps of 24 tokens do not fit the cast's 64-row register tiles:
    gpu.supports says no (and kv_cache_dtype_error says so at start-up)."""
    fn = jax.jit(functools.partial(_attend, impl="pallas"))
    args = _args(64, 8, 6, 2, 2, 128, 24, 32, jnp.int8)
    assert "mosaic_gpu" not in export.export(fn, platforms=["cuda"])(*args).mlir_module()
