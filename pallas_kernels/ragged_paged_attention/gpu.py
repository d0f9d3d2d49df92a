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
score is kept when kv <= q (and kv > q - window). Pages past the request's
NUM_PAGES are never fetched: such page slots re-read the request's last page
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
hardware (approx exp2/tanh), register pressure at H = 256, and performance
(the quantized casts run on the compute warpgroup, serially with its math).
Not supported (the dispatcher falls back to the XLA reference): float32 (WGMMA
would run it as TF32), head_dim outside {64, 128, 256}, G > 64, and for a
quantized cache KV steps that are not a multiple of 64 tokens (odd page sizes).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.ragged_paged_attention import blocks
from pallas_kernels.ragged_paged_attention.cache import cache_dims
from pallas_kernels.ragged_paged_attention.quant import is_quantized

ROWS = 64                     # one warpgroup's WGMMA M
_SMEM_BUDGET = 220 * 1024     # of the 227 KiB a Hopper CTA may use (barriers and reduction scratch take the rest)
_MASK_M = -1e30               # running-max floor: fully masked rows stay finite
LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    block_q: int      # tokens per item
    kv_step: int      # KV tokens per pipeline step
    piece: int        # rows per TMA copy (min(page_size, kv_step))
    stages: int       # KV ring depth
    num_ctas: int     # persistent CTAs (one per SM on hardware)


def supports(dtype, head_dim: int, num_heads: int, num_kv_heads: int, page_size: int) -> bool:
    group = num_heads // num_kv_heads
    # A quantized tile is cast ROWS rows at a time (the 8-bit WGMMA register layout).
    ok_dtype = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or (
        is_quantized(dtype) and _kv_step(head_dim, page_size) % ROWS == 0)
    return ok_dtype and head_dim in (64, 128, 256) and 1 <= group <= ROWS and page_size % 8 == 0


def compute_dtype(cache_dtype, q_dtype):
    """The dtype the tensor cores multiply in: the cache's for a 16-bit cache. A
    quantized one is cast in shared memory: fp8 to f16 (exact, one cvt; fp8 -> bf16
    needs a newer ptxas than the lowering may find, and f16 holds every fp8 value),
    int8 to q's 16-bit dtype, bf16 by default (exact either way: |x| <= 127)."""
    if not is_quantized(cache_dtype):
        return jnp.dtype(cache_dtype)
    if jnp.issubdtype(cache_dtype, jnp.floating):
        return jnp.dtype(jnp.float16)
    return jnp.dtype(q_dtype) if jnp.dtype(q_dtype).itemsize == 2 else jnp.dtype(jnp.bfloat16)


def _kv_step(head_dim: int, page_size: int) -> int:
    kv_step = 128 if head_dim <= 128 else 64
    if page_size % kv_step and kv_step % page_size:
        kv_step = page_size                # odd page sizes: one page per step
    return kv_step


def choose_config(head_dim: int, group: int, page_size: int, itemsize: int,
                  num_ctas: int, compute_itemsize: int | None = None) -> GpuConfig:
    """itemsize: the cache's (the TMA ring); compute_itemsize: the tiles the tensor
    cores read (q, and for a quantized cache the cast K and V copies)."""
    kv_step = _kv_step(head_dim, page_size)
    piece = min(page_size, kv_step)
    compute_itemsize = compute_itemsize or itemsize
    fixed = ROWS * head_dim * compute_itemsize
    if compute_itemsize != itemsize:
        fixed += 2 * kv_step * head_dim * compute_itemsize      # the cast K and V tiles
    stage_bytes = 2 * kv_step * head_dim * itemsize
    stages = max(2, min(4, (_SMEM_BUDGET - fixed) // stage_bytes))
    return GpuConfig(block_q=ROWS // group, kv_step=kv_step, piece=piece, stages=stages,
                     num_ctas=num_ctas)


def default_num_ctas() -> int:
    """SMs of the local GPU; an H100 SXM's 132 when there is none (lowering on CPU)."""
    dev = jax.devices()[0]
    if dev.platform == "gpu":
        return int(getattr(dev, "core_count", 0) or 132)
    return 132


def _swizzle_transforms(head_dim: int, itemsize: int):
    swizzle = min(128, head_dim * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _qk(q_smem, k_ref, shape, *, interpreted: bool):
    """Q K^T with an f32 result. GPU interpret mode (jax 0.10.2) cannot run a
    WGMMA on a transposed ref or with a register operand, so when interpreted
    the two products are plain dots on the loaded tiles; everything around them
    (TMA, barriers, masks, softmax) is the same code. The WGMMA forms are
    checked by the cuda lowering test."""
    if interpreted:
        return lax.dot_general(q_smem[...], k_ref[...], (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)

    def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_ref, (1, 0)))
        return acc_ref[...]
    return pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))


def _accumulate_pv(acc, p, v_ref, *, interpreted: bool):
    """acc + P V; on hardware the WGMMA accumulates into acc's registers."""
    if interpreted:
        return acc + jnp.dot(p, v_ref[...], preferred_element_type=jnp.float32)

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p, v_ref)
    return pl.run_state(pv)(plgpu.ACC.init(acc))


def _cast_tile(src, dst, *, interpreted: bool):
    """dst[...] = src[...] as dst's dtype (a quantized K or V tile into the 16-bit copy
    the WGMMA reads), ROWS rows at a time to bound the registers it takes."""
    rows = min(ROWS, src.shape[0])
    for r in range(0, src.shape[0], rows):
        part = src.at[pl.ds(r, rows)]
        x = part[...] if interpreted else plgpu.load(part, (), layout=plgpu.Layout.WGMMA_8BIT)
        dst[pl.ds(r, rows)] = x.astype(dst.dtype)
    plgpu.commit_smem()


def _kernel(meta_ref, pages_ref, q_ref, cache_ref, o_ref, q_smem, k_smem, v_smem,
            q_bar, k_full, v_full, k_free, v_free, *cast_smem, cfg: GpuConfig, group: int,
            num_kv_heads: int, page_size: int, sm_scale: float, soft_cap: float | None,
            sliding_window: int | None, interpreted: bool):
    """cast_smem: (K, V) 16-bit tiles for a quantized cache, none otherwise."""
    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")
    kv_step, piece, stages = cfg.kv_step, cfg.piece, cfg.stages
    head_dim = q_smem.shape[-1]
    dtype = q_smem.dtype
    # Persistent CTAs: unit u = (item u // K, kv head u % K), dealt round-robin.
    num_units = meta_ref[0, blocks.NUM_ITEMS] * num_kv_heads
    my_units = lax.div(jnp.maximum(num_units - cta, 0) + cfg.num_ctas - 1, cfg.num_ctas)

    def unit_loop(body, init):
        def run(n, carry):
            u = cta + n * cfg.num_ctas
            return body(lax.div(u, num_kv_heads), lax.rem(u, num_kv_heads), carry)
        return lax.fori_loop(0, my_units, run, init)

    @pl.when(wg == 0)
    def _compute():
        # GPU interpret mode has no layout_cast: layouts only matter when lowering.
        wgmma_layout = plgpu.Layout.WGMMA
        cast = (lambda x, _: x) if interpreted else plgpu.layout_cast
        iota = lambda shape, dim: cast(lax.broadcasted_iota(jnp.int32, shape, dim), wgmma_layout)

        def unit(item, head, done):            # done: KV steps consumed by earlier units
            num_steps = meta_ref[item, blocks.NUM_STEPS]
            q_pos = meta_ref[item, blocks.Q_POS]
            q_count = meta_ref[item, blocks.Q_COUNT]
            kv_len = meta_ref[item, blocks.KV_LEN]
            kv_lo = meta_ref[item, blocks.KV_LO]
            win_lo = None if sliding_window is None else blocks.window_start(q_pos, sliding_window)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # the last unit's output left q_smem
            plgpu.copy_gmem_to_smem(q_ref.at[item, head], q_smem, q_bar)
            plgpu.barrier_wait(q_bar)

            row = iota((ROWS, kv_step), 0)
            col = iota((ROWS, kv_step), 1)
            q_of_row = q_pos + jnp.minimum(lax.div(row, group), q_count - 1)
            m_i = cast(jnp.full((ROWS,), _MASK_M, jnp.float32), wgmma_layout.reduce(1))
            l_i = cast(jnp.full((ROWS,), 0.0, jnp.float32), wgmma_layout.reduce(1))
            acc = cast(jnp.full((ROWS, head_dim), 0.0, jnp.float32), wgmma_layout)

            def step(s, carry):
                acc, m_i, l_i = carry
                slot = lax.rem(done + s, stages)
                base = kv_lo + s * kv_step
                plgpu.barrier_wait(k_full.at[slot])
                k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
                if cast_smem:
                    # A quantized slot is cast once and freed at once; the WGMMAs of the
                    # previous step, which read the cast tiles, were waited for (their
                    # results are used before this point).
                    _cast_tile(k_tile, cast_smem[0], interpreted=interpreted)
                    plgpu.barrier_arrive(k_free.at[slot])
                    k_tile, v_tile = cast_smem
                scores = _qk(q_smem, k_tile, (ROWS, kv_step), interpreted=interpreted)
                if not cast_smem:
                    plgpu.barrier_arrive(k_free.at[slot])

                scores = scores * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * jnp.tanh(scores * (1.0 / soft_cap))
                kv_pos = base + col
                keep = kv_pos <= q_of_row
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
                    _cast_tile(v_smem.at[slot], v_tile, interpreted=interpreted)
                    plgpu.barrier_arrive(v_free.at[slot])

                stale = base + kv_step > kv_len
                if sliding_window is not None:
                    stale |= base < win_lo

                @pl.when(stale)
                def _zero_stale_v():
                    v = v_tile
                    vpos = base + iota((kv_step, head_dim), 0)
                    live = vpos < kv_len
                    if sliding_window is not None:
                        live &= vpos >= win_lo
                    v[...] = jnp.where(live, v[...], jnp.zeros_like(v[...]))
                    plgpu.commit_smem()

                acc = _accumulate_pv(acc, p.astype(dtype), v_tile, interpreted=interpreted)
                if not cast_smem:
                    plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            acc, m_i, l_i = lax.fori_loop(0, num_steps, step, (acc, m_i, l_i))
            out = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
            q_smem[...] = out.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, o_ref.at[item, head])
            return done + num_steps

        unit_loop(unit, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
        def unit(item, head, done):
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
                    plgpu.copy_gmem_to_smem(src, buf.at[slot, pl.ds(j * piece, piece)],
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


def ragged_paged_attention_gpu(q, cache, kv_lens, page_table, query_start_loc, num_seqs, *,
                               sm_scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None, interpret=False,
                               config: GpuConfig | None = None):
    """interpret: False, or GPU interpret-mode params (see interpret_params()).
    config: block sizes and CTA count; default choose_config(...)."""
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
        kv_step=cfg.kv_step, page_size=page_size, sliding_window=sliding_window)
    q_blocks = blocks.gather_queries(q.astype(compute), meta, num_kv_heads=num_kv,
                                     block_q=cfg.block_q, rows=ROWS)
    transforms = _swizzle_transforms(head_dim, compute.itemsize)
    kv_transforms = _swizzle_transforms(head_dim, itemsize)
    cast_tiles = [plgpu.SMEM((cfg.kv_step, head_dim), compute, transforms=transforms)
                  for _ in range(2 if compute != cache.dtype else 0)]
    pieces = cfg.kv_step // cfg.piece
    kernel = functools.partial(
        _kernel, cfg=cfg, group=group, num_kv_heads=num_kv, page_size=page_size, sm_scale=sm_scale,
        soft_cap=soft_cap, sliding_window=sliding_window, interpreted=bool(interpret))
    out_blocks = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_blocks.shape, compute),
        scratch_types=[
            plgpu.SMEM((ROWS, head_dim), compute, transforms=transforms),
            plgpu.SMEM((cfg.stages, cfg.kv_step, head_dim), cache.dtype, transforms=kv_transforms),
            plgpu.SMEM((cfg.stages, cfg.kv_step, head_dim), cache.dtype, transforms=kv_transforms),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_arrivals=pieces, num_barriers=cfg.stages),
            plgpu.Barrier(num_arrivals=pieces, num_barriers=cfg.stages),
            plgpu.Barrier(num_barriers=cfg.stages),
            plgpu.Barrier(num_barriers=cfg.stages),
            *cast_tiles,
        ],
        grid=(cfg.num_ctas,),
        grid_names=("cta",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(meta, page_table.astype(jnp.int32), q_blocks, cache)
    out = blocks.scatter_outputs(out_blocks, token_item, token_row, token_valid,
                                 num_heads=num_heads, block_q=cfg.block_q)
    return out.astype(q.dtype)


def interpret_params():
    """Parameters for Pallas GPU interpret mode (private in jax 0.10.2)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()
