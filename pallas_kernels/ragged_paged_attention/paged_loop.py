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
as the longest one while the others compute masked garbage: with such a mix
about half of all gathered pages are wasted. Instead the loop has L = I / F
lanes and each lane runs a queue of F items one after the other (the state is
reset between them): items sorted longest first are dealt to the queues in a
snake (lane 0 gets the longest and, in the next round, the shortest of that
round), which balances the queues, so the loop's trip count is about the mean,
not the maximum, of F items' steps. When a lane's item ends, its output is
written into the item's row and the lane starts its next item at the next step.

Glossary: T tokens, R request rows, I items, F items per lane, L lanes, K kv
heads, G = N // K query heads per kv head, M = block * G query rows per item,
S page size, P pages per step, C = P * S KV tokens per step, H head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.blocks import (KV_LEN, KV_LO, NUM_STEPS, Q_COUNT,
                                                          Q_POS, Q_START, REQ, gather_queries,
                                                          plan_items, scatter_outputs,
                                                          window_start)
from pallas_kernels.held_dtypes import as_values
from pallas_kernels.ragged_paged_attention.cache import cache_dims

BLOCK_Q = 16
# KV tokens per loop iteration (whole pages): fewer, larger iterations amortise the
# per-iteration cost of XLA's loop on CPU; 32 measured best on the CPU benchmark
# (16 costs 1.6x, 64 about 1.1x in the decode benchmark).
KV_STEP_TOKENS = 32
# Items each lane runs in turn (F). 1 is the old lock-step loop; 2 and 4 both cut
# the decode benchmark's attention by about a third (less waste), 4 slightly more;
# 8 loses when all contexts are equally long (too many thin iterations).
ITEMS_PER_LANE = 4


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
    per_step = max(1, min(KV_STEP_TOKENS // page_size, pages_per_req))   # pages per iteration
    kv_step = per_step * page_size
    meta, token_item, token_row, token_valid = plan_items(
        query_start_loc, kv_lens, num_seqs, num_tokens=num_tokens, block_q=block,
        kv_step=kv_step, page_size=page_size, sliding_window=sliding_window,
        row_mask=row_mask, num_items=num_items, horizon=horizon)
    qb = gather_queries(q, meta, num_kv_heads=num_kv, block_q=block, rows=rows)
    qb = qb.astype(jnp.float32) * sm_scale                       # [I, K, M, H]

    n_items = meta.shape[0]
    fold = min(ITEMS_PER_LANE, n_items)
    n_lanes = -(-n_items // fold)
    n_pad = n_lanes * fold                                       # padding items have 0 steps
    meta = jnp.pad(meta, ((0, n_pad - n_items), (0, 0)))
    qb = jnp.pad(qb, ((0, n_pad - n_items), (0, 0), (0, 0), (0, 0)))
    order = jnp.argsort(-meta[:, NUM_STEPS], stable=True)        # longest first
    deal = jnp.arange(n_pad, dtype=jnp.int32).reshape(fold, n_lanes)
    deal = jnp.where((jnp.arange(fold) % 2 == 1)[:, None], deal[:, ::-1], deal)
    queue = order[deal]                                          # [F, L] item ids
    steps = meta[queue, NUM_STEPS]
    ends = jnp.cumsum(steps, axis=0)                             # [F, L] loop step after each
    starts = ends - steps
    trips = jnp.max(ends[-1])

    tok = jnp.arange(rows, dtype=jnp.int32) // group             # token of each query row
    offsets = jnp.arange(kv_step, dtype=jnp.int32)
    lanes = jnp.arange(n_lanes, dtype=jnp.int32)
    # One row per page: all its kv heads' K and V tiles, contiguous. A 2-D gather of
    # whole rows is XLA CPU's fastest gather per byte (long contiguous runs; gathering
    # K alone, or transposing inside the gather, was several times slower per byte),
    # and the K / V relayouts below then read the freshly gathered rows from cache.
    page_rows = cache.reshape(num_pages, num_kv * 2 * page_size * head_dim)

    def position(t):
        """[L] index into each lane's queue of the item it runs at step t (F: none)."""
        return jnp.sum(ends <= t, axis=0)

    def schedule(t):
        f = position(t)
        fi = jnp.minimum(f, fold - 1)
        item = queue[fi, lanes]                                  # [L]
        mt = meta[item]
        active = f < fold                                        # t is one of its steps
        first = mt[:, KV_LO] // page_size + (t - starts[fi, lanes]) * per_step   # first page
        idx = jnp.clip(first[:, None] + jnp.arange(per_step)[None, :], 0, pages_per_req - 1)
        page = jnp.where(active[:, None], page_table[mt[:, REQ, None], idx], 0)   # [L, P]
        slot = first[:, None] * page_size + offsets[None, :]                  # [L, C]
        slot_ok = active[:, None] & (slot < mt[:, KV_LEN, None])              # [L, C]
        if sliding_window is not None:
            # Slots before the window of the item's first query: never needed, and
            # selected away like those past KV_LEN (the first page's may be garbage).
            slot_ok &= slot >= window_start(mt[:, Q_POS, None], sliding_window)
        row_pos = mt[:, Q_POS, None] + tok[None, :]                           # [L, M]
        row_last = row_pos if horizon is None else jnp.maximum(
            row_pos, horizon[jnp.minimum(mt[:, Q_START, None] + tok[None, :], num_tokens - 1)])
        mask = (slot_ok[:, None, :] & (tok[None, :] < mt[:, Q_COUNT, None])[:, :, None]
                & (slot[:, None, :] <= row_last[:, :, None]))                 # [L, M, C]
        if sliding_window is not None:
            mask &= slot[:, None, :] > row_pos[:, :, None] - sliding_window
        return item, page, slot_ok, mask

    shape = (n_lanes, num_kv, rows)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))

    def retire(t, m, l, acc, out):
        """Lanes whose item ran its last step at t - 1 write its output; their state restarts."""
        prev = position(t - 1)
        done = (prev != position(t)) & (t > 0)                  # [L]
        dest = jnp.where(done, queue[jnp.minimum(prev, fold - 1), lanes], n_pad)   # n_pad: dropped
        out = out.at[dest].set(acc / jnp.where(l > 0, l, 1.0)[..., None], mode="drop")
        m, l, acc = (jnp.where(done.reshape((-1,) + (1,) * (x.ndim - 1)), x0, x)
                     for x, x0 in zip((m, l, acc), init))
        return m, l, acc, out

    def step(t, carry):
        m, l, acc, out = retire(t, *carry)
        item, page, slot_ok, mask = schedule(t)
        kv = as_values(page_rows[page.reshape(-1)]).reshape(
            n_lanes, per_step, num_kv, 2, page_size, head_dim)
        # K as [L, K, H, C] so that q @ K is a plain matmul (XLA CPU's dot is several times
        # slower on the transposed form); the select after the transpose keeps XLA from
        # folding the transpose back into the dot. Both selects zero every KV slot that
        # must not be read (NaN-safe: p == 0 would not cancel a NaN in V).
        kT = kv[:, :, :, 0].transpose(0, 2, 4, 1, 3).reshape(n_lanes, num_kv, head_dim, kv_step)
        kT = jnp.where(slot_ok[:, None, None, :], kT.astype(jnp.float32), 0.0)
        v = kv[:, :, :, 1].transpose(0, 2, 1, 3, 4).reshape(n_lanes, num_kv, kv_step, head_dim)
        v = jnp.where(slot_ok[:, None, :, None], v.astype(jnp.float32), 0.0)
        scores = jnp.einsum("LKMH,LKHC->LKMC", qb[item], kT, precision="highest")
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(mask[:, None], scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(mask[:, None], jnp.exp(scores - base[..., None]), 0.0)
        scale = jnp.where(jnp.isfinite(m), jnp.exp(m - base), 0.0)
        acc = acc * scale[..., None] + jnp.einsum("LKMC,LKCH->LKMH", p, v, precision="highest")
        return m_new, l * scale + jnp.sum(p, axis=-1), acc, out

    carry = jax.lax.fori_loop(0, trips, step, init + (jnp.zeros(qb.shape, jnp.float32),))
    *_, out = retire(trips, *carry)                              # items ending at the last step
    return scatter_outputs(out[:n_items].astype(q.dtype), token_item, token_row, token_valid,
                           num_heads=num_heads, block_q=block)
