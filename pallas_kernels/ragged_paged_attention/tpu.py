"""Ragged paged attention for TPU, written with Pallas Mosaic TPU.

Grid (I,): one program per item (a query block of one request, blocks.py),
covering all K kv heads, so one DMA per page brings K and V of every head
(the cache's [2K, S, H] page is contiguous).
  - Scalar prefetch: only the item metadata (I x NUM_FIELDS int32) sits in SMEM
    before the grid starts. The page table stays in HBM: SMEM holds 1 MiB, and
    a whole table (rows x pages per request, e.g. 256 x 16384 int32 = 16 MiB)
    does not fit. Each item DMAs windows of its own row (IDX_WINDOW page
    indices, double-buffered, the next window fetched while the current one is
    in use) into SMEM, so page indices are still plain scalar loads.
  - Queries and outputs are [K, M, H] tiles (M = BQ * G rows, GQA heads of a
    kv head share every K/V load) moved by the BlockSpec pipeline.
  - The cache stays in HBM (memory_space ANY); the item's KV steps (KV_STEP
    tokens = PPS pages) are double-buffered by hand: step s+1's page DMAs start
    before step s is computed. Page slots past the request's last page re-read
    that last page (never an unlisted page) and are masked.
  - Per step and kv head: S = Q K^T on the MXU (f32 accumulation), positional
    mask (kv <= the row's position, or its horizon: a [M, 1] tile beside the queries
    when Gemma 4's image tokens see their whole image), online softmax with the running max / sum in VMEM scratch, then
    P V. V rows at or past KV_LEN are selected to zero first (stale slots may
    hold NaN and 0 * NaN is NaN).
Decode and prefill chunks are the same code path.
A quantized cache (fp8 / int8; its scales are folded into q and the output by
dispatch.py) is DMA'd as stored -- the KV buffers keep its one-byte dtype, the
bandwidth saving -- and each K / V tile is cast to q's dtype in VMEM; the
query and output tiles are in q's dtype then.

Verified without a TPU: TPU interpret mode on CPU (the logic, DMAs and
semaphores) and compilation by libtpu's deviceless XLA:TPU + Mosaic compilers
for v5e and v6e (tests/kernels/test_rpa_tpu_compile.py; quantized caches:
tests/kernels/test_kv_quant.py). The item metadata is
the one SMEM figure that grows (with the token bucket): smem_limit_error says
when a shape would not fit. Unverified: running on a TPU, performance and
block-size tuning. Known limit: the first KV step (and index
window) of each item is not prefetched during the previous item.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import blocks, cost
from pallas_kernels.ragged_paged_attention.cache import cache_dims
from pallas_kernels.ragged_paged_attention.quant import is_quantized

_MXU_ROWS = 128                  # target query rows per item
_KV_BUF_BYTES = 2 * 1024 * 1024  # one KV slot (all heads); two slots are live
_MAX_KV_STEP = 256
_MASK_M = -1e30                  # running-max floor: fully masked rows stay finite
IDX_WINDOW = 512                 # page indices per SMEM window (2 KiB; two are live)
SMEM_BYTES = 1 << 20             # scalar memory per TensorCore on v5e, v5p and v6e
_SMEM_SLACK = 16 * 1024          # what Mosaic keeps for itself (measured: 1 MiB - 16 KiB fits)


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    block_q: int            # tokens per item
    rows: int               # M, block_q * G rounded up to the sublane tile
    pages_per_step: int
    kv_step: int            # pages_per_step * page_size
    idx_window: int = IDX_WINDOW   # page-table slots per SMEM window (tests: small)
    idx_align: int = 128           # window starts: the page table's lane tile in HBM


def _block_q(group: int) -> int:
    return max(1, _MXU_ROWS // group)


def choose_config(group: int, page_size: int, num_kv_heads: int, head_dim: int,
                  itemsize: int, compute_itemsize: int | None = None) -> TpuConfig:
    """itemsize: the cache's (KV buffer bytes); compute_itemsize: the query tiles'
    (default the same; q's dtype for a quantized cache, whose tiles are cast)."""
    block_q = _block_q(group)
    sublanes = 8 * (4 // (compute_itemsize or itemsize))   # 8 rows of f32, 16 of bf16
    rows = -(-block_q * group // sublanes) * sublanes
    per_token = num_kv_heads * 2 * head_dim * itemsize
    want = max(page_size, min(_MAX_KV_STEP, _KV_BUF_BYTES // per_token))
    pages = max(1, want // page_size)
    return TpuConfig(block_q=block_q, rows=rows, pages_per_step=pages, kv_step=pages * page_size)


def smem_bytes(num_tokens: int, num_rows: int, group: int, pages_per_req: int) -> int:
    """SMEM one call takes: the scalar-prefetched item metadata (it grows with the token
    bucket and the rows) and the two page-index windows (bounded by IDX_WINDOW)."""
    items = blocks.max_items(num_tokens, num_rows, _block_q(group))
    return 4 * (items * blocks.NUM_FIELDS + 2 * min(pages_per_req, IDX_WINDOW))


def smem_limit_error(num_tokens: int, num_rows: int, group: int, pages_per_req: int
                     ) -> str | None:
    """Why a call of this shape would not compile (Mosaic: out of SMEM), with the largest
    token bucket that would; None when it fits."""
    budget = SMEM_BYTES - _SMEM_SLACK
    if smem_bytes(num_tokens, num_rows, group, pages_per_req) <= budget:
        return None
    lo, hi = 0, num_tokens            # the largest multiple of 16 tokens that fits
    while hi - lo > 16:
        mid = (lo + hi) // 32 * 16
        lo, hi = (mid, hi) if smem_bytes(mid, num_rows, group, pages_per_req) <= budget \
            else (lo, mid)
    return (f"{num_tokens} tokens over {num_rows} rows need "
            f"{smem_bytes(num_tokens, num_rows, group, pages_per_req):,} bytes of TPU SMEM for "
            f"the attention kernel's work items, more than the {budget:,} it can have; "
            f"lower max_num_batched_tokens to {lo} or fewer")


@dataclasses.dataclass(frozen=True)
class _Windows:
    """How an item's page indices come from its page-table row (in HBM) into SMEM.

    One window when the row fits (size = the row). Otherwise window w holds the
    `size` slots from its start: the slot of KV step w * steps rounded down to
    `align` (Mosaic DMAs a [R, 1, P] table only at lane-tile offsets), capped so
    it stays in the row padded to `row`; `steps` = (size - align) // pages per
    step, so the window holds all of its steps' slots whatever the rounding."""
    size: int
    steps: int | None       # None: a single window holds the whole row
    align: int
    row: int                # the row length the kernel sees (padded to align)


def _windows(pages_per_req: int, cfg: TpuConfig) -> _Windows:
    if pages_per_req <= cfg.idx_window:
        return _Windows(pages_per_req, None, 1, pages_per_req)
    steps = (cfg.idx_window - cfg.idx_align) // cfg.pages_per_step
    if cfg.idx_window % cfg.idx_align or steps < 1:
        raise ValueError(f"idx_window {cfg.idx_window}: must be a multiple of idx_align "
                         f"{cfg.idx_align} and hold it plus one KV step")
    row = -(-pages_per_req // cfg.idx_align) * cfg.idx_align
    return _Windows(cfg.idx_window, steps, cfg.idx_align, row)


def _kernel(meta_ref, q_ref, *refs, cfg: TpuConfig, win: _Windows, group: int,
            num_kv_heads: int, page_size: int, sm_scale: float, soft_cap: float | None,
            sliding_window: int | None, has_horizon: bool):
    """refs: with has_horizon, first the item's row horizons [rows, 1] (blocks.row_horizons);
    then the cache, the page table, the output tile and the scratch buffers."""
    hz_ref, refs = (refs[0], refs[1:]) if has_horizon else (None, refs)
    cache_hbm, pages_hbm, o_ref, kv_buf, sems, idx_buf, idx_sems, m_scr, l_scr, acc_scr = refs
    item = pl.program_id(0)
    field = lambda f: meta_ref[item * blocks.NUM_FIELDS + f]
    num_steps = field(blocks.NUM_STEPS)
    req, q_pos, q_count = field(blocks.REQ), field(blocks.Q_POS), field(blocks.Q_COUNT)
    kv_len, kv_lo, last_page = field(blocks.KV_LEN), field(blocks.KV_LO), field(blocks.NUM_PAGES) - 1
    page_lo = lax.div(kv_lo, page_size)          # KV_LO is page-aligned (kv_step >= page_size)
    pps, kv_step, rows = cfg.pages_per_step, cfg.kv_step, cfg.rows

    def window_start(w):
        """The first page-table slot window w holds (lax.div, not //: the sign fix-up
        of // queries the local chip, which fails in deviceless compiles)."""
        if win.steps is None:
            return 0
        first = lax.div(page_lo + w * win.steps * pps, win.align) * win.align
        return pl.multiple_of(jnp.minimum(first, win.row - win.size), win.align)

    def window_copy(w, slot):
        return pltpu.make_async_copy(pages_hbm.at[req, 0, pl.ds(window_start(w), win.size)],
                                     idx_buf.at[slot], idx_sems.at[slot])

    def copies(s, slot):
        w = 0 if win.steps is None else lax.div(s, win.steps)
        w_slot, w_first = (0 if win.steps is None else lax.rem(w, 2)), window_start(w)
        first = page_lo + s * pps
        out = []
        for j in range(pps):
            page = idx_buf[w_slot, jnp.minimum(first + j, last_page) - w_first]
            out.append(pltpu.make_async_copy(cache_hbm.at[page], kv_buf.at[slot, j], sems.at[slot]))
        return out

    @pl.when(num_steps == 0)
    def _idle():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(num_steps > 0)
    def _run():
        m_scr[...] = jnp.full(m_scr.shape, _MASK_M, jnp.float32)
        l_scr[...] = jnp.full(l_scr.shape, 0.0, jnp.float32)
        acc_scr[...] = jnp.full(acc_scr.shape, 0.0, jnp.float32)
        first_window = window_copy(0, 0)
        first_window.start()
        first_window.wait()
        if win.steps is not None:
            @pl.when(win.steps < num_steps)
            def _next_window():
                window_copy(1, 1).start()
        for c in copies(0, 0):
            c.start()

        compute = q_ref.dtype          # the cache's, or q's when the cache is quantized
        precision = lax.Precision.HIGHEST if compute == jnp.float32 else None

        def step(s, carry):
            slot = lax.rem(s, 2)
            for c in copies(s, slot):
                c.wait()
            nxt = s + 1
            if win.steps is not None:
                # Entering a new window: it was fetched during the previous one; the
                # slot of that previous one is free now, so the window after starts.
                @pl.when((lax.rem(nxt, win.steps) == 0) & (nxt < num_steps))
                def _cross():
                    w = lax.div(nxt, win.steps)
                    window_copy(w, lax.rem(w, 2)).wait()

                    @pl.when((w + 1) * win.steps < num_steps)
                    def _after():
                        window_copy(w + 1, lax.rem(w + 1, 2)).start()

            @pl.when(nxt < num_steps)
            def _prefetch():
                for c in copies(nxt, 1 - slot):
                    c.start()

            base = kv_lo + s * kv_step
            # Token of each query row (row = t * G + g; padding rows copy the last real
            # token). t = floor((row + 0.5) / G) in f32 is exact here and avoids a
            # vector integer division.
            row = lax.broadcasted_iota(jnp.int32, (rows, kv_step), 0).astype(jnp.float32)
            tok = ((row + 0.5) * (1.0 / group)).astype(jnp.int32)
            q_of_row = q_pos + jnp.minimum(tok, q_count - 1)
            kv_pos = base + lax.broadcasted_iota(jnp.int32, (rows, kv_step), 1)
            # Causal, or up to each row's horizon (an image token sees its whole image).
            keep = kv_pos <= (q_of_row if hz_ref is None else hz_ref[...])
            if sliding_window is not None:
                keep &= kv_pos > q_of_row - sliding_window
            v_pos = base + lax.broadcasted_iota(jnp.int32, (kv_step, kv_buf.shape[-1]), 0)
            v_live = v_pos < kv_len
            if sliding_window is not None:     # before the first query's window: not needed
                v_live &= v_pos >= blocks.window_start(q_pos, sliding_window)
            for h in range(num_kv_heads):
                # [PPS, S, H] -> [L, H]; a quantized page is cast here, in VMEM (the DMA
                # moved its narrow bytes); the cast is a no-op for a float cache.
                k = kv_buf[slot, :, 2 * h].astype(compute).reshape(kv_step, -1)
                v = kv_buf[slot, :, 2 * h + 1].astype(compute).reshape(kv_step, -1)
                v = jnp.where(v_live, v, jnp.zeros_like(v))
                q = q_ref[h]                                           # [M, H]
                scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32,
                                         precision=precision) * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * jnp.tanh(scores / soft_cap)
                scores = jnp.where(keep, scores, -jnp.inf)
                m_prev = m_scr[h][:, :1]                               # [M, 1]
                m_new = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))
                alpha = jnp.exp(m_prev - m_new)
                p = jnp.exp(scores - m_new)
                l_scr[h] = jnp.broadcast_to(alpha * l_scr[h][:, :1] + p.sum(axis=1, keepdims=True),
                                            l_scr.shape[1:])
                m_scr[h] = jnp.broadcast_to(m_new, m_scr.shape[1:])
                pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32,
                             precision=precision)
                acc_scr[h] = alpha * acc_scr[h] + pv
            return carry

        lax.fori_loop(0, num_steps, step, 0)
        for h in range(num_kv_heads):
            o_ref[h] = (acc_scr[h] / l_scr[h][:, :1]).astype(o_ref.dtype)


def ragged_paged_attention_tpu(q: jax.Array, cache: jax.Array, kv_lens: jax.Array,
                               page_table: jax.Array, query_start_loc: jax.Array,
                               num_seqs: jax.Array, *, sm_scale: float,
                               sliding_window: int | None = None,
                               soft_cap: float | None = None,
                               interpret: bool | pltpu.InterpretParams = False,
                               config: TpuConfig | None = None,
                               horizon: jax.Array | None = None) -> jax.Array:
    """interpret: False, or TPU interpret-mode params (pltpu.InterpretParams()).
    config: block sizes (tests use small ones); default choose_config(...).
    horizon: int32[T] the last position each token sees (reference.py); the window still
    bounds the past side from the token's own position."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv, _ = cache_dims(cache)
    group = num_heads // num_kv
    # A quantized cache (scales folded by the caller) is read narrow and computed in q's dtype.
    compute = q.dtype if is_quantized(cache.dtype) else cache.dtype
    cfg = config or choose_config(group, page_size, num_kv, head_dim, jnp.dtype(cache.dtype).itemsize,
                                  jnp.dtype(compute).itemsize)
    if cfg.kv_step != cfg.pages_per_step * page_size or cfg.rows < cfg.block_q * group:
        raise ValueError(f"inconsistent {cfg} for page_size {page_size}, G {group}")
    meta, token_item, token_row, token_valid = blocks.plan_items(
        query_start_loc, kv_lens, num_seqs, num_tokens=num_tokens, block_q=cfg.block_q,
        kv_step=cfg.kv_step, page_size=page_size, sliding_window=sliding_window, horizon=horizon)
    q_blocks = blocks.gather_queries(q.astype(compute), meta, num_kv_heads=num_kv,
                                     block_q=cfg.block_q, rows=cfg.rows)
    n_items = meta.shape[0]
    with_horizon = () if horizon is None else (
        blocks.row_horizons(meta, horizon, group=group, rows=cfg.rows)[..., None],)
    num_pages, pages_per_req = cache.shape[0], page_table.shape[1]
    win = _windows(pages_per_req, cfg)
    # [R, 1, P]: the row axis untiled, so a DMA may start at any row.
    pages = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, win.row - pages_per_req)))
    pages = pages.reshape(page_table.shape[0], 1, win.row)
    kernel = functools.partial(
        _kernel, cfg=cfg, win=win, group=group, num_kv_heads=num_kv, page_size=page_size,
        sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        has_horizon=horizon is not None)
    tile = pl.BlockSpec((None, num_kv, cfg.rows, head_dim), lambda i, *_: (i, 0, 0, 0))
    hz_tile = pl.BlockSpec((None, cfg.rows, 1), lambda i, *_: (i, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    out_blocks = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q_blocks.shape, compute),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n_items,),
            in_specs=[tile, *(hz_tile,) * len(with_horizon), hbm, hbm],
            out_specs=tile,
            scratch_shapes=[
                pltpu.VMEM((2, cfg.pages_per_step, 2 * num_kv, page_size, head_dim), cache.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((2, win.size), jnp.int32),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((num_kv, cfg.rows, 128), jnp.float32),
                pltpu.VMEM((num_kv, cfg.rows, 128), jnp.float32),
                pltpu.VMEM((num_kv, cfg.rows, head_dim), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        # Names the kernel in the compiled program (jaxserve/planning/step_bytes.py
        # accounts its KV reads at the rows' real context).
        metadata={"jaxserve_kernel": "ragged_paged_attention",
                  "sliding_window": str(sliding_window or 0)},
        cost_estimate=cost.attention_cost(
            num_tokens=num_tokens, num_heads=num_heads, head_dim=head_dim,
            num_rows=page_table.shape[0], pages_per_req=pages_per_req, page_size=page_size,
            num_pages=num_pages, num_kv_heads=num_kv, itemsize=jnp.dtype(cache.dtype).itemsize,
            sliding_window=sliding_window),
        interpret=interpret,
    )(meta.reshape(-1), q_blocks, *with_horizon, cache, pages)
    out = blocks.scatter_outputs(out_blocks, token_item, token_row, token_valid,
                                 num_heads=num_heads, block_q=cfg.block_q)
    return out.astype(q.dtype)
