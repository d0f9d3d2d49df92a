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

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from tests.tpu_compile import compile_on_tpu

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
