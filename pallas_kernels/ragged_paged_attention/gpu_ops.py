"""The Mosaic GPU pieces of the Hopper kernel (gpu.py): shared-memory tilings, a register
layout, column blocks of a ref, and the two matmuls and the quantized tile cast, each
with the plain form GPU interpret mode runs on CPU."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.ragged_paged_attention.gpu_plan import ROWS


def swizzle_transforms(head_dim: int, itemsize: int, rows: int | None = None) -> tuple[Any, ...]:
    """rows: for a P V operand (V, [rows, head_dim]), whose rows are the WGMMA's
    contraction dim: that must be a multiple of the swizzle (in elements), so 32-token
    steps (head_dim 512) take a 64-byte swizzle."""
    swizzle = min(128, head_dim * itemsize, (rows or 128) * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def rows32_layout() -> Any:
    """A warpgroup register layout for [32k, 8n] tiles (WGMMA's needs 64k rows): tiles
    of 32 x 8, a warp per 8 rows, lanes over 8 rows x 4 column pairs, 2-vectors. For
    zeroing the stale rows of 32-token V tiles (head_dim 512)."""
    return plgpu.Layout.TILED(fragmented_array.Tiling(((32, 8), (8, 8), (2,))),
                              warp_dims=(-5,), lane_dims=(-3, -2), vector_dim=-1)


def column_blocks(ref: Any, splits: int, *lead: Any) -> list[Any]:
    """The column blocks of ref.at[*lead]: itself when there is one, else the
    [..., rows, cols] entries of its (next) leading axis."""
    if splits == 1:
        return [ref.at[lead] if lead else ref]
    return [ref.at[(*lead, c)] for c in range(splits)]


def qk_scores(q_parts: list[Any], k_parts: list[Any], shape: tuple[int, int], *,
              interpreted: bool) -> jax.Array:
    """Q K^T with an f32 result. GPU interpret mode (jax 0.10.2) cannot run a
    WGMMA on a transposed ref or with a register operand, so when interpreted
    the two products are plain dots on the loaded tiles; everything around them
    (TMA, barriers, masks, softmax) is the same code. The WGMMA forms are
    checked by the cuda lowering test.
    Q and K come as lists of column blocks (column_blocks): the product sums over them."""
    if interpreted:
        return sum(lax.dot_general(q[...], k[...], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
                   for q, k in zip(q_parts, k_parts, strict=True))

    def run(acc_ref):
        for q, k in zip(q_parts, k_parts, strict=True):
            plgpu.wgmma(acc_ref, q, plgpu.transpose_ref(k, (1, 0)))
        return acc_ref[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def accumulate_pv(acc: jax.Array, p: jax.Array, v_ref: Any, *, interpreted: bool) -> jax.Array:
    """acc + P V; on hardware the WGMMA accumulates into acc's registers."""
    if interpreted:
        return acc + jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32)

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p, v_ref)
    return pl.run_state(pv)(plgpu.ACC.init(acc))


def cast_tiles(srcs: list[Any], dsts: list[Any], *, interpreted: bool) -> None:
    """dst[...] = src[...] as dst's dtype for each pair (a quantized K or V tile, in
    column blocks, into the 16-bit copy the WGMMA reads), ROWS rows at a time to
    bound the registers it takes."""
    for src, dst in zip(srcs, dsts, strict=True):
        rows = min(ROWS, src.shape[0])
        for r in range(0, src.shape[0], rows):
            part = src.at[pl.ds(r, rows)]
            x = part[...] if interpreted else plgpu.load(part, (), layout=plgpu.Layout.WGMMA_8BIT)
            dst[pl.ds(r, rows)] = x.astype(dst.dtype)
    plgpu.commit_smem()
