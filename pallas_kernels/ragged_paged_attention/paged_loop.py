"""Ragged paged attention in plain XLA, fast enough to serve on CPU.

The reference (reference.py) gathers every token's whole context at once:
simple, but it materialises [T, context] worth of K/V per call. This version runs
the same work items as the Pallas kernels (blocks.py: one item = one query
block of one request) with an online softmax over KV steps of C tokens (whole
pages), so the live K/V is a few pages per item whatever the context length,
and no step past a request's length is run.

Decode-sized batches (T <= R) use one token per item. In larger batches the
rows with more than one token (prefill chunks) use BLOCK_Q tokens per item, so a
chunk reads each of its pages once per BLOCK_Q tokens instead of once per token,
and the one-token rows (decodes) still get one-token items, in a second loop.

Scheduling. Items need very different step counts (a decode batch mixes 20-
and 480-token contexts), and a loop that steps all items together runs as long
as the longest one while the others compute masked garbage. So the items, sorted
longest first, run in F rounds of L = I / F lanes: round f takes the f-th L of
them, one item a lane, and loops as long as its own longest item. Sorted, a
round's items need about as many steps as each other, so the F loops together
run about as many steps as the items need, and each round starts and ends
outside its loop: the per-step work is the item's KV step and nothing else.

Per step a lane reads its item's KV pages as (page, kv head) tiles, K and V
apart, so they arrive as [K, C, H] with no relayout, and both dots take them as
stored (bf16 into bf16 dots with float32 accumulation where the CPU has them,
attention_dot_dtype); other caches are read as float32.

Glossary: T tokens, R request rows, I items, F rounds, L lanes, K kv
heads, G = N // K query heads per kv head, M = block * G query rows per item,
S page size, P pages per step, C = P * S KV tokens per step, H head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from pallas_kernels.ragged_paged_attention.blocks import (KV_LEN, KV_LO, NUM_STEPS, Q_COUNT,
                                                          Q_POS, REQ, gather_queries, plan_items,
                                                          row_horizons, scatter_outputs,
                                                          window_start)
from pallas_kernels.held_dtypes import as_values, cpu_has_bf16_dot, value_dtype
from pallas_kernels.ragged_paged_attention.cache import cache_dims

BLOCK_Q = 16
# KV tokens per loop step (whole pages), measured on the CPU benchmarks (a 48-row decode at
# ~270 tokens of context; a 2048-token prefill chunk of 200-token prompts): one-token items
# (decodes) 32 (16 costs 1.8x, 64 and 128 1.0-1.2x), BLOCK_Q-token items (prefill chunks)
# 64 (16 costs 2.2x, 32 1.3x, 128 1.0-1.1x).
KV_STEP_TOKENS = 32
KV_STEP_TOKENS_BLOCKS = 64
# Rounds (F). 1 is one lock-step loop over all items (as long as the longest); on the same
# benchmarks 4 beat 1 by 1.4-1.5x, 2 by 1.1-1.5x and 8 by 1.1-1.2x.
ROUNDS = 4


def attention_dot_dtype(cache_dtype: DTypeLike) -> jnp.dtype:
    """bf16 K / V go into bf16 dots as stored (float32 accumulation), except on a CPU that
    emulates bf16 dots: there float32 ones on the same values are faster (a 48-row decode
    1.24x, a 2048-token prefill chunk 1.15x on an AVX2 EPYC) and exact. Other caches in
    float32."""
    native = jax.default_backend() != "cpu" or cpu_has_bf16_dot()
    bf16 = value_dtype(cache_dtype) == jnp.bfloat16 and native
    return jnp.dtype(jnp.bfloat16 if bf16 else jnp.float32)


def ragged_paged_attention(
    q: jax.Array,                 # [T, N, H]
    cache: jax.Array,             # [num_pages, 2K, S, H]
    kv_lens: jax.Array,           # int32[R] KV length after this step
    page_table: jax.Array,        # int32[R, P]
    query_start_loc: jax.Array,   # int32[R + 1]
    num_seqs: jax.Array,          # int32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_q: int | None = None,   # tokens per item; default 1 when T <= R, else BLOCK_Q
    horizon: jax.Array | None = None,   # int32[T] the last position each token sees
) -> jax.Array:                   # [T, N, H]
    """horizon: see reference.py (default: each token's own position)."""
    num_tokens, num_rows = q.shape[0], page_table.shape[0]
    common = (q, cache, kv_lens, page_table, query_start_loc, num_seqs)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
              horizon=horizon)
    if block_q or num_tokens <= num_rows:
        return _attend(*common, block=block_q or 1, **kw)
    # A mixed batch: one-token rows (decodes) as one-token items, the rest (prefill
    # chunks) in BLOCK_Q blocks. A decode in a BLOCK_Q-token item would compute
    # BLOCK_Q times the rows it needs, which made decodes most of a mixed step's
    # attention. Each token belongs to exactly one of the two, the other gives it 0.
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    decode = _attend(*common, block=1, row_mask=q_len == 1, num_items=num_rows, **kw)
    chunks = _attend(*common, block=BLOCK_Q, row_mask=q_len != 1, **kw)
    return decode + chunks


def _attend(q, cache, kv_lens, page_table, query_start_loc, num_seqs, *, block, sm_scale,
            sliding_window, soft_cap, horizon, row_mask=None, num_items=None):
    """The rows row_mask selects (all by default) with `block` tokens per item; other
    tokens get zeros."""
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv, _ = cache_dims(cache)
    group = num_heads // num_kv
    pages_per_req = page_table.shape[1]
    rows = block * group
    step_tokens = KV_STEP_TOKENS if block == 1 else KV_STEP_TOKENS_BLOCKS
    per_step = max(1, min(step_tokens // page_size, pages_per_req))   # pages per step
    kv_step = per_step * page_size
    meta, token_item, token_row, token_valid = plan_items(
        query_start_loc, kv_lens, num_seqs, num_tokens=num_tokens, block_q=block,
        kv_step=kv_step, page_size=page_size, sliding_window=sliding_window,
        row_mask=row_mask, num_items=num_items, horizon=horizon)
    dot_dtype = attention_dot_dtype(cache.dtype)
    # Each round gathers its own items' query tiles (from q scaled once): no [I, K, M, H]
    # tiles of every item up front (a prefill chunk's: a 12.6 MB pass; 3-4 % of its call).
    q_scaled = (q.astype(jnp.float32) * sm_scale).astype(dot_dtype)   # [T, N, H]

    n_items = meta.shape[0]
    fold = min(ROUNDS, n_items)
    n_lanes = -(-n_items // fold)
    n_pad = n_lanes * fold                                       # padding items have 0 steps
    meta = jnp.pad(meta, ((0, n_pad - n_items), (0, 0)))
    order = jnp.argsort(-meta[:, NUM_STEPS], stable=True).astype(jnp.int32)   # longest first

    tok = jnp.arange(rows, dtype=jnp.int32) // group             # token of each query row
    offsets = jnp.arange(kv_step, dtype=jnp.int32)
    # One row per (page, kv head) tile, K and V rows apart: gathered [L, K, P] tiles are
    # [L, K, C, H] as the dots take them (gathering whole pages needed two relayouts).
    tiles = cache.reshape(num_pages * 2 * num_kv, page_size * head_dim)
    k_tile = 2 * jnp.arange(num_kv, dtype=jnp.int32)             # K rows of a page; V: + 1
    shape = (n_lanes, num_kv, rows)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))

    def run_round(item):
        """Items `item` [L], one a lane, each over its own steps: the loop runs as long as the
        longest of them."""
        mt = meta[item]
        q_round = gather_queries(q_scaled, mt, num_kv_heads=num_kv, block_q=block,
                                 rows=rows)                                   # [L, K, M, H]
        row_pos = mt[:, Q_POS, None] + tok[None, :]                           # [L, M]
        row_last = row_pos if horizon is None else \
            row_horizons(mt, horizon, group=group, rows=rows)   # padding rows: masked
        row_ok = tok[None, :] < mt[:, Q_COUNT, None]

        def step(s, carry):
            m, l, acc = carry
            active = s < mt[:, NUM_STEPS]                                     # [L]
            first = mt[:, KV_LO] // page_size + s * per_step                  # first page
            idx = jnp.clip(first[:, None] + jnp.arange(per_step)[None, :], 0, pages_per_req - 1)
            page = jnp.where(active[:, None], page_table[mt[:, REQ, None], idx], 0)   # [L, P]
            slot = first[:, None] * page_size + offsets[None, :]              # [L, C]
            slot_ok = active[:, None] & (slot < mt[:, KV_LEN, None])
            if sliding_window is not None:
                # Slots before the window of the item's first query: never needed, and
                # selected away like those past KV_LEN (the first page's may be garbage).
                slot_ok &= slot >= window_start(mt[:, Q_POS, None], sliding_window)
            mask = (slot_ok[:, None, :] & row_ok[:, :, None]
                    & (slot[:, None, :] <= row_last[:, :, None]))             # [L, M, C]
            if sliding_window is not None:
                mask &= slot[:, None, :] > row_pos[:, :, None] - sliding_window
            tile = page[:, None, :] * (2 * num_kv) + k_tile[None, :, None]    # [L, K, P]
            k = as_values(tiles[tile]).reshape(n_lanes, num_kv, kv_step, head_dim)
            v = as_values(tiles[tile + 1]).reshape(n_lanes, num_kv, kv_step, head_dim)
            # Slots that must not be read may hold anything: their scores are selected away
            # below, and V's are zeroed (p == 0 would not cancel a NaN there).
            v = jnp.where(slot_ok[:, None, :, None], v, jnp.zeros((), v.dtype))
            # Written K x q^T, then transposed: XLA folds that into dot(q, K), K the operand
            # YNNPACK packs each step; of the forms measured (benchmarks/README.md, "Where
            # the rest of the gap is") none was faster.
            scores = jnp.einsum("LKCH,LKMH->LKCM", k.astype(dot_dtype), q_round,
                                preferred_element_type=jnp.float32).swapaxes(-1, -2)
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            scores = jnp.where(mask[:, None], scores, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
            base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.where(mask[:, None], jnp.exp(scores - base[..., None]), 0.0)
            scale = jnp.where(jnp.isfinite(m), jnp.exp(m - base), 0.0)
            pv = jnp.einsum("LKMC,LKCH->LKMH", p.astype(dot_dtype), v.astype(dot_dtype),
                            preferred_element_type=jnp.float32)
            return m_new, l * scale + jnp.sum(p, axis=-1), acc * scale[..., None] + pv

        _, l, acc = jax.lax.fori_loop(0, jnp.max(mt[:, NUM_STEPS]), step, init)
        return acc / jnp.where(l > 0, l, 1.0)[..., None]

    def next_round(f, out):
        # one loop over the rounds, not F copies of the step loop: compiles like one
        item = jax.lax.dynamic_slice_in_dim(order, f * n_lanes, n_lanes)
        return jax.lax.dynamic_update_index_in_dim(out, run_round(item), f, 0)

    out = jax.lax.fori_loop(0, fold, next_round, jnp.zeros((fold,) + shape + (head_dim,),
                                                           jnp.float32))
    out = out.reshape((n_pad,) + out.shape[2:])[jnp.argsort(order)]   # back to item order
    return scatter_outputs(out[:n_items].astype(q.dtype), token_item, token_row, token_valid,
                           num_heads=num_heads, block_q=block)
