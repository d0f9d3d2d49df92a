"""What the Hopper ragged paged attention kernel (gpu.py) runs, and how it tiles the work:
which dtypes, head dims and GQA groups it takes (the dispatcher falls back to the XLA
reference for the rest), the dtype its tensor cores multiply in, and the block sizes and
pipeline depth that fit a CTA's shared memory."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.quant import is_quantized

ROWS = 64                     # one warpgroup's WGMMA M
MAX_COLS = 256                # head-dim columns one unit accumulates (see cols_per_unit)
SMEM_BUDGET = 220 * 1024      # of the 227 KiB a Hopper CTA may use (barriers and reduction scratch take the rest)


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    block_q: int      # tokens per item
    kv_step: int      # KV tokens per pipeline step
    piece: int        # rows per TMA copy (min(page_size, kv_step))
    stages: int       # KV ring depth
    num_ctas: int     # persistent CTAs (one per SM on hardware)


HEAD_DIMS = (64, 128, 256, 512)


def supports(dtype: Any, head_dim: int, num_heads: int, num_kv_heads: int, page_size: int) -> bool:
    group = num_heads // num_kv_heads
    # A quantized tile is cast ROWS rows at a time (the 8-bit WGMMA register layout).
    ok_dtype = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or (
        is_quantized(dtype) and kv_step_tokens(head_dim, page_size) % ROWS == 0)
    return ok_dtype and head_dim in HEAD_DIMS and 1 <= group <= ROWS and page_size % 8 == 0


def cols_per_unit(head_dim: int) -> int:
    """Output columns per unit: the f32 accumulator of [ROWS, cols] takes cols / 2
    registers per thread of the warpgroup, so 256 (128 registers) is the most that
    leaves room for the scores and the softmax; head_dim 512 runs as two units per
    (item, kv head), each with all of Q K^T and half of P V."""
    return min(head_dim, MAX_COLS)


def compute_dtype(cache_dtype: Any, q_dtype: Any) -> jnp.dtype:
    """The dtype the tensor cores multiply in: the cache's for a 16-bit cache. A
    quantized one is cast in shared memory: fp8 to f16 (exact, one cvt; fp8 -> bf16
    needs a newer ptxas than the lowering may find, and f16 holds every fp8 value),
    int8 to q's 16-bit dtype, bf16 by default (exact either way: |x| <= 127)."""
    if not is_quantized(cache_dtype):
        return jnp.dtype(cache_dtype)
    if jnp.issubdtype(cache_dtype, jnp.floating):
        return jnp.dtype(jnp.float16)
    return jnp.dtype(q_dtype) if jnp.dtype(q_dtype).itemsize == 2 else jnp.dtype(jnp.bfloat16)


def kv_step_tokens(head_dim: int, page_size: int) -> int:
    # head_dim 512: a stage holds all of K and half of V (48 KiB at 32 tokens); two
    # stages, the [64, 512] Q tile and the [64, 256] output tile fill shared memory.
    kv_step = 128 if head_dim <= 128 else 64 if head_dim <= 256 else 32
    if page_size % kv_step and kv_step % page_size:
        kv_step = page_size                # odd page sizes: one page per step
    return kv_step


def choose_config(head_dim: int, group: int, page_size: int, itemsize: int,
                  num_ctas: int, compute_itemsize: int | None = None) -> GpuConfig:
    """itemsize: the cache's (the TMA ring); compute_itemsize: the tiles the tensor
    cores read (q, and for a quantized cache the cast K and V copies)."""
    kv_step = kv_step_tokens(head_dim, page_size)
    piece = min(page_size, kv_step)
    compute_itemsize = compute_itemsize or itemsize
    cols = cols_per_unit(head_dim)
    fixed = ROWS * head_dim * compute_itemsize                  # the Q tile
    if cols < head_dim:
        fixed += ROWS * cols * compute_itemsize                 # the output tile
    tile = (head_dim + cols) * kv_step                          # K and a V column block
    if compute_itemsize != itemsize:
        fixed += tile * compute_itemsize                        # the cast K and V tiles
    stage_bytes = tile * itemsize
    stages = max(2, min(4, (SMEM_BUDGET - fixed) // stage_bytes))
    return GpuConfig(block_q=ROWS // group, kv_step=kv_step, piece=piece, stages=stages,
                     num_ctas=num_ctas)


def default_num_ctas() -> int:
    """SMs of the local GPU; an H100 SXM's 132 when there is none (lowering on CPU)."""
    dev = jax.devices()[0]
    if dev.platform == "gpu":
        return int(getattr(dev, "core_count", 0) or 132)
    return 132
