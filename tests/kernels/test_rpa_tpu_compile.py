"""The TPU ragged paged attention kernel compiled by the real XLA:TPU + Mosaic compilers
(libtpu's deviceless AOT compiler on this CPU), for v5e and v6e, at small shapes and at
production ones: lowering alone missed an SMEM overflow (the whole page table was
scalar-prefetched) that only Mosaic's own passes find.

Decode, prefill and mixed steps differ in their token and row buckets (T, R), not in
the kernel; GQA groups 1-8, head dims 64-512 and pages of 16-256 tokens are covered,
and the largest page table the engine builds: 256 rows at 262,144 tokens.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from tests.tpu_compile import compile_on_tpu, hlo_lines

CONTEXT = 262_144
SHAPES = [  # (name, T, R, pages per request, kv heads, group, head_dim, page size, pages)
    ("small-decode", 8, 8, 6, 2, 1, 64, 16, 64),
    ("small-mixed-g8", 64, 8, 6, 1, 8, 128, 128, 32),
    ("qwen3-8b-decode-256", 256, 256, CONTEXT // 16, 8, 4, 128, 16, 4096),
    ("qwen3.6-27b-1x8-decode-256", 256, 256, CONTEXT // 16, 1, 6, 256, 16, 8192),
    ("qwen3.6-27b-1x8-prefill", 2048, 16, CONTEXT // 16, 1, 6, 256, 16, 8192),
    ("gemma-like-h512-s256-mixed", 512, 64, CONTEXT // 256, 2, 2, 512, 256, 512),
    ("g2-h256-s64-decode", 64, 64, CONTEXT // 64, 4, 2, 256, 64, 2048),
]


def _args(t, r, p, k, g, h, s, n):
    i32 = jnp.int32
    return (jax.ShapeDtypeStruct((t, k * g, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, 2 * k, s, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((r,), i32), jax.ShapeDtypeStruct((r, p), i32),
            jax.ShapeDtypeStruct((r + 1,), i32), jax.ShapeDtypeStruct((1,), i32))


@pytest.mark.parametrize("target", ["tpu-v5e", "tpu-v6e"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_compiles_for_tpu(target, shape):
    name, t, r, p, k, g, h, s, n = shape
    fn = functools.partial(ragged_paged_attention, impl="pallas", sm_scale=h ** -0.5)
    compiled = compile_on_tpu(fn, *_args(t, r, p, k, g, h, s, n), target=target)
    assert "tpu_custom_call" in compiled.as_text()
    # The kernel's cost estimate reaches XLA: every (query, position) pair of the page
    # table's context is counted (4 flops per head dim and query head).
    cost = compiled.cost_analysis()
    assert cost["flops"] >= 4 * h * k * g * t * p * s
    assert cost["bytes accessed"] > 0


# Gemma 4 per-device shapes (max_model_len 32,767, pages of 16): sliding layers (window
# 1024, head_dim 256) and global ones (head_dim 512). 31B: 32 query heads, 16 sliding /
# 4 global kv heads; on a 1x8 mesh a device has 4 query heads with 2 sliding kv heads,
# or 1 global kv head (4 replicated to 8). name: (target, cache dtype, T, R, K, G, H, W)
GEMMA4_P = -(-32_767 // 16)
GEMMA4 = {
    "31b-1x8-sliding-decode": ("tpu-v6e", jnp.bfloat16, 256, 256, 2, 2, 256, 1024),
    "31b-1x8-sliding-prefill-fp8": ("tpu-v6e", jnp.float8_e4m3fn, 8192, 16, 2, 2, 256, 1024),
    "31b-1x8-global-prefill": ("tpu-v6e", jnp.bfloat16, 8192, 16, 1, 4, 512, None),
    "31b-1x8-global-decode-fp8": ("tpu-v5e", jnp.float8_e4m3fn, 256, 256, 1, 4, 512, None),
    "31b-1x1-sliding-decode": ("tpu-v5e", jnp.bfloat16, 256, 256, 16, 2, 256, 1024),
    "31b-1x1-global-mixed-fp8": ("tpu-v6e", jnp.float8_e4m3fn, 2048, 64, 4, 8, 512, None),
}
# Mosaic's default scoped VMEM limit per chip (the kernel asks for no more).
SCOPED_VMEM = {"tpu-v5e": 16 << 20, "tpu-v6e": 32 << 20}


def kernel_vmem_bytes(hlo: str) -> int:
    """The scoped VMEM the compiled attention kernel (the one tpu_custom_call) uses."""
    [line] = [ln for ln in hlo_lines(hlo) if 'custom_call_target="tpu_custom_call"' in ln]
    return int(re.search(r'"used_scoped_memory_configs":\[\{"memory_space":"1","offset":"0",'
                         r'"size":"(\d+)"', line).group(1))


@pytest.mark.parametrize("name", list(GEMMA4))
def test_gemma4_shapes_compile(name):
    """Compiles within the chip's scoped VMEM; the cache goes to the kernel as stored (no
    convert or copy of it); the cost estimate counts W positions per query on sliding
    layers (flops) and only the pages the windows cover (bytes)."""
    from pallas_kernels.ragged_paged_attention import cost

    target, dtype, t, r, k, g, h, w = GEMMA4[name]
    n = 32_768                                   # pages: more than the rows' windows cover
    q, cache, *rest = _args(t, r, GEMMA4_P, k, g, h, 16, n)
    cache = jax.ShapeDtypeStruct(cache.shape, dtype)
    quantized = dtype != jnp.bfloat16
    scale = jax.ShapeDtypeStruct((k, 2), jnp.float32) if quantized else None

    def fn(q, cache, *a):
        *a, kv_scale = a if quantized else (*a, None)
        return ragged_paged_attention(q, cache, *a, kv_scale=kv_scale, impl="pallas",
                                      sm_scale=1.0, sliding_window=w)

    compiled = compile_on_tpu(fn, q, cache, *rest, *([scale] if quantized else []),
                              target=target)
    hlo = compiled.as_text()
    assert 0 < kernel_vmem_bytes(hlo) <= SCOPED_VMEM[target]
    dims = ",".join(map(str, cache.shape))
    made = [ln for ln in hlo_lines(hlo) if re.search(r"= \w+\[{}\]\{{".format(dims), ln)
            and " parameter(" not in ln]
    assert not made, made
    context = GEMMA4_P * 16 if w is None else w
    kernel_flops = 4 * h * k * g * t * context
    got = compiled.cost_analysis()
    assert kernel_flops <= got["flops"] <= 1.05 * kernel_flops
    page_bytes = 2 * k * 16 * h * jnp.dtype(dtype).itemsize
    pages = cost.pages_read(num_tokens=t, num_rows=r, pages_per_req=GEMMA4_P, page_size=16,
                            num_pages=n, sliding_window=w)
    assert got["bytes accessed"] >= pages * page_bytes
    if w is not None:            # far below what the whole page-table rows would be
        assert pages * page_bytes * 4 < min(r, t) * GEMMA4_P * page_bytes


@pytest.mark.parametrize("name", ["31b-1x8-sliding-decode", "31b-1x8-sliding-prefill-fp8"])
def test_gemma4_image_horizon_compiles(name):
    """Gemma 4's sliding layers with images (each token's horizon: its image's last
    position) compile within the scoped VMEM, the cache still read as stored."""
    target, dtype, t, r, k, g, h, w = GEMMA4[name]
    q, cache, *rest = _args(t, r, GEMMA4_P, k, g, h, 16, 32_768)
    cache = jax.ShapeDtypeStruct(cache.shape, dtype)
    scale = jax.ShapeDtypeStruct((k, 2), jnp.float32)

    def fn(q, cache, kv_lens, table, starts, num_seqs, horizon, kv_scale):
        return ragged_paged_attention(q, cache, kv_lens, table, starts, num_seqs, impl="pallas",
                                      sm_scale=1.0, sliding_window=w, horizon=horizon,
                                      kv_scale=kv_scale if dtype != jnp.bfloat16 else None)

    compiled = compile_on_tpu(fn, q, cache, *rest, jax.ShapeDtypeStruct((t,), jnp.int32), scale,
                              target=target)
    hlo = compiled.as_text()
    assert 0 < kernel_vmem_bytes(hlo) <= SCOPED_VMEM[target]
    dims = ",".join(map(str, cache.shape))
    assert not [ln for ln in hlo_lines(hlo) if re.search(r"= \w+\[{}\]\{{".format(dims), ln)
                and " parameter(" not in ln]


def test_sliding_window_and_soft_cap_compile():
    fn = functools.partial(ragged_paged_attention, impl="pallas", sm_scale=0.1,
                           sliding_window=1024, soft_cap=30.0)
    compile_on_tpu(fn, *_args(256, 64, CONTEXT // 16, 2, 4, 128, 16, 2048), target="tpu-v6e")


def test_smem_limit_is_where_mosaic_runs_out():
    """The item metadata grows with the token bucket: at 16 query heads per KV head,
    262,144 tokens over 256 rows need more SMEM than a TensorCore has. smem_limit_error
    names the largest bucket that fits; it compiles, the original does not."""
    from pallas_kernels.ragged_paged_attention import tpu

    t, r, g, p = 262_144, 256, 16, 64
    why = tpu.smem_limit_error(t, r, g, p)
    assert why is not None and "lower max_num_batched_tokens to" in why
    largest = int(why.rsplit(" to ", 1)[1].split()[0])
    assert tpu.smem_limit_error(largest, r, g, p) is None
    assert tpu.smem_bytes(largest + 16, r, g, p) > tpu.SMEM_BYTES - 16 * 1024
    assert tpu.smem_bytes(t, r, g, p) > tpu.SMEM_BYTES
    fn = functools.partial(ragged_paged_attention, impl="pallas", sm_scale=0.1)
    compile_on_tpu(fn, *_args(largest, r, p, 1, g, 128, 16, 4096), target="tpu-v6e")
    with pytest.raises(Exception, match="smem"):
        compile_on_tpu(fn, *_args(t, r, p, 1, g, 128, 16, 4096), target="tpu-v6e")
