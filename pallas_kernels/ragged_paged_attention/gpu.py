"""Ragged paged attention for Hopper, written with Pallas Mosaic GPU.

Why Mosaic GPU and not Pallas-Triton: Triton is deprecated upstream, and in
jax 0.10.2 a Mosaic GPU kernel lowers (and exports for "cuda") on a machine
without a GPU and runs in GPU interpret mode on CPU, so both the lowering and
the kernel's logic are checked in CPU CI.

Work: one unit = one item (a query block of one request, blocks.py) for one
kv head. The grid is persistent: one CTA per SM, CTA c takes units c, c + #CTAs,
... (the real unit count is read from the metadata, so padding costs nothing).
Each CTA has two warpgroups:
  - the memory warpgroup walks the KV steps of its units: each step is KV_STEP
    tokens, fetched by TMA straight from the request's pages (one box per page,
    or a slice of a page when pages are larger than a step) into a ring of
    STAGES shared-memory slots. K and V have their own "full" barriers, so
    Q K^T can start while V is in flight, and "free" barriers that the compute
    warpgroup arrives on when done with a slot. The ring runs on across units,
    so the next unit's first pages load while the current one finishes;
  - the compute warpgroup holds the unit's M = 64 query rows (BQ = 64 // G
    tokens x the G query heads of the kv head, so GQA heads share each K/V
    load), runs S = Q K^T on the tensor cores (WGMMA, f32 accumulator), an
    online softmax in registers (exp2, running max and sum per row) and P V
    (WGMMA with P from registers), then writes the normalised [M, H] tile by TMA.
Decode (one token) and prefill chunks are the same code: a decode unit simply
has G live rows and one step per KV_STEP tokens of context.
A quantized cache (fp8 / int8, scales folded by dispatch.py) rides the TMA ring
in its one-byte dtype (half the bytes); the compute warpgroup casts each K and
V slot into a 16-bit tile in shared memory (WGMMA reads its B operand from
there), frees the slot at once and runs the WGMMAs on the copy. fp8 is cast to
f16 (exact; fp8 -> bf16 needs a newer ptxas), int8 to q's 16-bit dtype.

Masking is positional: row m is token t = m // G of the block, position
Q_POS + min(t, Q_COUNT - 1) (padding rows copy the last real row so they
stay finite); column c of step s is position KV_LO + s * KV_STEP + c; a
score is kept when kv <= q (and kv > q - window); with a horizon (Gemma 4's image
tokens) kv <= the row's horizon instead, loaded into shared memory with the queries.
Pages past the request's NUM_PAGES are never fetched: such page slots re-read the request's last page
and are masked; with a window, pages entirely before the window of the item's
first query are never fetched either (KV_LO, blocks.py). On the last step (and,
with a window, the first), V rows at or past KV_LEN (before the window start)
are zeroed in shared memory first, because stale slot contents may be NaN and
0 * NaN is NaN in the P V product.

Verified on CPU: the logic in GPU interpret mode (same kernel, except that the
two matmuls are plain dots there and layout casts are skipped: the interpreter
in jax 0.10.2 has neither WGMMA on transposed/register operands nor
layout_cast), and the hardware form by exporting for "cuda" (the Pallas ->
Mosaic GPU lowering checks WGMMA shapes, layouts, TMA boxes and the
shared-memory budget). Unverified without a GPU: PTX compilation, numerics on
hardware (approx exp2/tanh), register pressure at H = 256 and 512, and performance
(the quantized casts run on the compute warpgroup, serially with its math).
head_dim 512 (Gemma 4's global layers): a [64, 512] f32 accumulator would take
256 registers per thread, more than a thread has, so each (item, kv head) is
two units, one per 256-column block of the output: each runs all of Q K^T
(Q and K in shared memory as two column blocks, two WGMMAs into one
accumulator) and P V for its block (the V ring holds only that block). K is
read twice, V once: 1.5x the KV traffic of one pass, and Q K^T twice. KV steps
are 32 tokens (two stages of K and half of V, the Q tile and an output tile fit
shared memory), so the V tile, the WGMMA's contraction operand, takes a 64-byte
swizzle and stale V rows are zeroed in a 32-row register layout.
Not supported (the dispatcher falls back to the XLA reference): float32 (WGMMA
would run it as TF32), head_dim outside {64, 128, 256, 512}, G > 64, and for a
quantized cache KV steps that are not a multiple of 64 tokens (odd page sizes,
and head_dim 512).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_gpu_params import compiler_params
from pallas_kernels.ragged_paged_attention import blocks
from pallas_kernels.ragged_paged_attention.cache import cache_dims
from pallas_kernels.ragged_paged_attention.gpu_ops import (accumulate_pv, cast_tiles,
                                                           column_blocks, qk_scores,
                                                           rows32_layout, swizzle_transforms)
# What the kernel supports and how it tiles (gpu_plan.py), re-exported for the dispatcher.
from pallas_kernels.ragged_paged_attention.gpu_plan import (HEAD_DIMS, MAX_COLS, ROWS, GpuConfig,
                                                            choose_config, cols_per_unit,
                                                            compute_dtype, default_num_ctas,
                                                            supports)

__all__ = ["HEAD_DIMS", "MAX_COLS", "ROWS", "GpuConfig", "choose_config", "compute_dtype",
           "default_num_ctas", "interpret_params", "ragged_paged_attention_gpu", "supports"]

_MASK_M = -1e30               # running-max floor: fully masked rows stay finite
LOG2E = math.log2(math.e)


def _kernel(meta_ref, pages_ref, q_ref, cache_ref, *refs, cfg: GpuConfig, group: int,
            num_kv_heads: int, page_size: int, sm_scale: float, soft_cap: float | None,
            sliding_window: int | None, interpreted: bool, splits: int, has_horizon: bool):
    """splits: column blocks of the head dim (cols_per_unit). With one, q_smem [ROWS, H] and
    the K and V rings [stages, kv_step, H] hold whole rows and q_smem stages the
    output. With more, q_smem [splits, ROWS, cols] and the K ring [stages, splits,
    kv_step, cols] hold all head_dim = splits * cols columns in column blocks, the V
    ring [stages, kv_step, cols] only the unit's output columns, and extra[0] is
    the [ROWS, cols] output tile (GPU interpret mode cannot TMA from a block of
    q_smem). The rest of extra: the (K, V) 16-bit tiles of a quantized cache (K in
    column blocks like its ring), none for a 16-bit cache.
    has_horizon: refs start with the row horizons [I, ROWS] (blocks.row_horizons) and
    extra ends with their [ROWS] SMEM tile, loaded with the unit's queries."""
    hz_ref, refs = (refs[0], refs[1:]) if has_horizon else (None, refs)
    o_ref, q_smem, k_smem, v_smem, q_bar, k_full, v_full, k_free, v_free, *extra = refs
    hz_smem = extra.pop() if has_horizon else None
    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")
    kv_step, piece, stages = cfg.kv_step, cfg.piece, cfg.stages
    cols = q_smem.shape[-1]
    dtype = q_smem.dtype
    o_smem, cast_smem = (q_smem, extra) if splits == 1 else (extra[0], extra[1:])
    # Persistent CTAs: unit u = (item, kv head, column block) in that order of
    # significance, dealt round-robin.
    per_item = num_kv_heads * splits
    num_units = meta_ref[0, blocks.NUM_ITEMS] * per_item
    my_units = lax.div(jnp.maximum(num_units - cta, 0) + cfg.num_ctas - 1, cfg.num_ctas)

    def unit_loop(body, init):
        def run(n, carry):
            u = cta + n * cfg.num_ctas
            rest = lax.rem(u, per_item)
            return body(lax.div(u, per_item), lax.div(rest, splits), lax.rem(rest, splits),
                        carry)
        return lax.fori_loop(0, my_units, run, init)

    def columns(ref, c: int):
        """ref[:, column block c] of a 2-D ref."""
        return ref.at[pl.ds(0, ref.shape[0]), pl.ds(c * cols, cols)]

    @pl.when(wg == 0)
    def _compute():
        # GPU interpret mode has no layout_cast: layouts only matter when lowering.
        wgmma_layout = plgpu.Layout.WGMMA
        cast = (lambda x, _: x) if interpreted else plgpu.layout_cast
        iota = lambda shape, dim: cast(lax.broadcasted_iota(jnp.int32, shape, dim), wgmma_layout)

        def unit(item, head, cblk, done):      # done: KV steps consumed by earlier units
            num_steps = meta_ref[item, blocks.NUM_STEPS]
            q_pos = meta_ref[item, blocks.Q_POS]
            q_count = meta_ref[item, blocks.Q_COUNT]
            kv_len = meta_ref[item, blocks.KV_LEN]
            kv_lo = meta_ref[item, blocks.KV_LO]
            win_lo = None if sliding_window is None else blocks.window_start(q_pos, sliding_window)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # the last unit's output left o_smem
            q_parts = column_blocks(q_smem, splits)
            for c, q_part in enumerate(q_parts):
                src = q_ref.at[item, head] if splits == 1 else q_ref.at[item, head, c]
                plgpu.copy_gmem_to_smem(src, q_part, q_bar)
            if has_horizon:
                plgpu.copy_gmem_to_smem(hz_ref.at[item], hz_smem, q_bar)
            plgpu.barrier_wait(q_bar)

            row = iota((ROWS, kv_step), 0)
            col = iota((ROWS, kv_step), 1)
            q_of_row = q_pos + jnp.minimum(lax.div(row, group), q_count - 1)
            # Causal, or up to each row's horizon (an image token sees its whole image).
            row_last = q_of_row
            if has_horizon:
                hz = hz_smem[...] if interpreted else \
                    plgpu.load(hz_smem, (), layout=wgmma_layout.reduce(1))
                row_last = lax.broadcast_in_dim(hz, (ROWS, kv_step), [0])
            m_i = cast(jnp.full((ROWS,), _MASK_M, jnp.float32), wgmma_layout.reduce(1))
            l_i = cast(jnp.full((ROWS,), 0.0, jnp.float32), wgmma_layout.reduce(1))
            acc = cast(jnp.full((ROWS, cols), 0.0, jnp.float32), wgmma_layout)

            def step(s, carry):
                acc, m_i, l_i = carry
                slot = lax.rem(done + s, stages)
                base = kv_lo + s * kv_step
                plgpu.barrier_wait(k_full.at[slot])
                k_parts, v_tile = column_blocks(k_smem, splits, slot), v_smem.at[slot]
                if cast_smem:
                    # A quantized slot is cast once and freed at once; the WGMMAs of the
                    # previous step, which read the cast tiles, were waited for (their
                    # results are used before this point).
                    cast_k = column_blocks(cast_smem[0], splits)
                    cast_tiles(k_parts, cast_k, interpreted=interpreted)
                    plgpu.barrier_arrive(k_free.at[slot])
                    k_parts, v_tile = cast_k, cast_smem[1]
                scores = qk_scores(q_parts, k_parts, (ROWS, kv_step), interpreted=interpreted)
                if not cast_smem:
                    plgpu.barrier_arrive(k_free.at[slot])

                scores = scores * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * jnp.tanh(scores * (1.0 / soft_cap))
                kv_pos = base + col
                keep = kv_pos <= row_last
                if sliding_window is not None:
                    keep &= kv_pos > q_of_row - sliding_window
                scores = jnp.where(keep, scores * LOG2E, -jnp.inf)     # log2 domain
                m_new = jnp.maximum(m_i, scores.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(scores - lax.broadcast_in_dim(m_new, scores.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                plgpu.barrier_wait(v_full.at[slot])
                if cast_smem:
                    cast_tiles([v_smem.at[slot]], [v_tile], interpreted=interpreted)
                    plgpu.barrier_arrive(v_free.at[slot])

                stale = base + kv_step > kv_len
                if sliding_window is not None:
                    stale |= base < win_lo

                @pl.when(stale)
                def _zero_stale_v():
                    v = v_tile
                    if interpreted or kv_step % ROWS == 0:
                        vpos = base + iota((kv_step, cols), 0)
                        x = v[...]
                    else:
                        lay = rows32_layout()
                        vpos = base + plgpu.layout_cast(
                            lax.broadcasted_iota(jnp.int32, (kv_step, cols), 0), lay)
                        x = plgpu.load(v, (), layout=lay)
                    live = vpos < kv_len
                    if sliding_window is not None:
                        live &= vpos >= win_lo
                    v[...] = jnp.where(live, x, jnp.zeros_like(x))
                    plgpu.commit_smem()

                acc = accumulate_pv(acc, p.astype(dtype), v_tile, interpreted=interpreted)
                if not cast_smem:
                    plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            acc, m_i, l_i = lax.fori_loop(0, num_steps, step, (acc, m_i, l_i))
            out = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
            o_smem[...] = out.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[item, head] if splits == 1
                                    else o_ref.at[item, head, cblk])
            return done + num_steps

        unit_loop(unit, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
        def unit(item, head, cblk, done):
            num_steps = meta_ref[item, blocks.NUM_STEPS]
            req = meta_ref[item, blocks.REQ]
            kv_lo = meta_ref[item, blocks.KV_LO]
            last_page = meta_ref[item, blocks.NUM_PAGES] - 1

            def fetch(s, which, buf, full, free):
                g = done + s                       # ring position of this step
                slot = lax.rem(g, stages)

                @pl.when(g >= stages)
                def _wait_free():
                    plgpu.barrier_wait(free.at[slot])

                base = kv_lo + s * kv_step
                for j in range(kv_step // piece):
                    start = base + j * piece
                    # Past the request's pages: re-read its last page (masked later).
                    page = pages_ref[req, jnp.minimum(start // page_size, last_page)]
                    src = cache_ref.at[page, 2 * head + which, pl.ds(start % page_size, piece)]
                    dst = pl.ds(j * piece, piece)
                    if splits == 1:
                        plgpu.copy_gmem_to_smem(src, buf.at[slot, dst], full.at[slot])
                    elif which == 0:    # K: every column block
                        for c in range(splits):
                            plgpu.copy_gmem_to_smem(columns(src, c), buf.at[slot, c, dst],
                                                    full.at[slot])
                    else:               # V: the unit's output columns (static slices)
                        for c in range(splits):
                            @pl.when(cblk == c)
                            def _v():
                                plgpu.copy_gmem_to_smem(columns(src, c), buf.at[slot, dst],
                                                        full.at[slot])

            @pl.loop(0, num_steps)
            def _steps(s):
                fetch(s, 0, k_smem, k_full, k_free)
                fetch(s, 1, v_smem, v_full, v_free)
            return done + num_steps

        total = unit_loop(unit, jnp.int32(0))

        # Observe the compute warpgroup's last releases, so every barrier phase
        # is consumed before the barriers go away (GPU interpret mode checks this).
        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _drain(g):
            plgpu.barrier_wait(k_free.at[lax.rem(g, stages)])
            plgpu.barrier_wait(v_free.at[lax.rem(g, stages)])


def ragged_paged_attention_gpu(q: jax.Array, cache: jax.Array, kv_lens: jax.Array,
                               page_table: jax.Array, query_start_loc: jax.Array,
                               num_seqs: jax.Array, *, sm_scale: float,
                               sliding_window: int | None = None, soft_cap: float | None = None,
                               interpret: Any = False, config: GpuConfig | None = None,
                               horizon: jax.Array | None = None) -> jax.Array:
    """interpret: False, or GPU interpret-mode params (see interpret_params()).
    config: block sizes and CTA count; default choose_config(...).
    horizon: int32[T] the last position each token sees (reference.py); the window still
    bounds the past side from the token's own position."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv, _ = cache_dims(cache)
    group = num_heads // num_kv
    itemsize = jnp.dtype(cache.dtype).itemsize
    compute = compute_dtype(cache.dtype, q.dtype)
    # Interpret mode compiles every CTA separately (seconds each): keep it to two.
    num_ctas = 2 if interpret else default_num_ctas()
    cfg = config or choose_config(head_dim, group, page_size, itemsize, num_ctas,
                                  compute.itemsize)
    if cfg.block_q * group > ROWS or cfg.kv_step % cfg.piece or page_size % cfg.piece:
        raise ValueError(f"inconsistent {cfg} for page_size {page_size}, G {group}")
    meta, token_item, token_row, token_valid = blocks.plan_items(
        query_start_loc, kv_lens, num_seqs, num_tokens=num_tokens, block_q=cfg.block_q,
        kv_step=cfg.kv_step, page_size=page_size, sliding_window=sliding_window, horizon=horizon)
    cols = cols_per_unit(head_dim)
    splits = head_dim // cols
    q_blocks = blocks.gather_queries(q.astype(compute), meta, num_kv_heads=num_kv,
                                     block_q=cfg.block_q, rows=ROWS)
    transforms = swizzle_transforms(cols, compute.itemsize)
    kv_transforms = swizzle_transforms(cols, itemsize)
    v_transforms = swizzle_transforms(cols, compute.itemsize, cfg.kv_step)   # WGMMA's V tile
    blk = () if splits == 1 else (splits,)          # a column-block axis, when split
    extra = [] if splits == 1 else [plgpu.SMEM((ROWS, cols), compute, transforms=transforms)]
    if compute != cache.dtype:                      # the cast K and V tiles
        extra += [plgpu.SMEM((*blk, cfg.kv_step, cols), compute, transforms=transforms),
                  plgpu.SMEM((cfg.kv_step, cols), compute, transforms=v_transforms)]
    with_horizon = () if horizon is None else (
        blocks.row_horizons(meta, horizon, group=group, rows=ROWS),)
    extra += [plgpu.SMEM((ROWS,), jnp.int32)] * len(with_horizon)
    pieces = cfg.kv_step // cfg.piece
    kernel = functools.partial(
        _kernel, cfg=cfg, group=group, num_kv_heads=num_kv, page_size=page_size, sm_scale=sm_scale,
        soft_cap=soft_cap, sliding_window=sliding_window, interpreted=bool(interpret),
        splits=splits, has_horizon=horizon is not None)
    # Split: Q and the output as column blocks [I, K, splits, ROWS, cols], so the kernel
    # moves a block with one TMA copy at a leading-axis index.
    n_items = q_blocks.shape[0]
    q_in = q_blocks if splits == 1 else \
        q_blocks.reshape(n_items, num_kv, ROWS, splits, cols).transpose(0, 1, 3, 2, 4)
    out_blocks = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_in.shape, compute),
        scratch_types=[
            plgpu.SMEM((*blk, ROWS, cols), compute, transforms=transforms),
            plgpu.SMEM((cfg.stages, *blk, cfg.kv_step, cols), cache.dtype,
                       transforms=kv_transforms),
            plgpu.SMEM((cfg.stages, cfg.kv_step, cols), cache.dtype,
                       transforms=kv_transforms if compute != cache.dtype else v_transforms),
            plgpu.Barrier(num_arrivals=splits + len(with_horizon), num_barriers=1),
            plgpu.Barrier(num_arrivals=pieces * splits, num_barriers=cfg.stages),
            plgpu.Barrier(num_arrivals=pieces, num_barriers=cfg.stages),
            plgpu.Barrier(num_barriers=cfg.stages),
            plgpu.Barrier(num_barriers=cfg.stages),
            *extra,
        ],
        grid=(cfg.num_ctas,),
        grid_names=("cta",),
        num_threads=2,
        thread_name="wg",
        compiler_params=compiler_params(approx_math=True),
        interpret=interpret,
    )(meta, page_table.astype(jnp.int32), q_in, cache, *with_horizon)
    if splits > 1:
        out_blocks = out_blocks.transpose(0, 1, 3, 2, 4).reshape(q_blocks.shape)
    out = blocks.scatter_outputs(out_blocks, token_item, token_row, token_valid,
                                 num_heads=num_heads, block_q=cfg.block_q)
    return out.astype(q.dtype)


def interpret_params() -> Any:
    """Parameters for Pallas GPU interpret mode (private in jax 0.10.2)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()
