"""Ragged paged attention in plain XLA, fast enough to serve on CPU.

The reference (reference.py) gathers every token's whole context at once:
simple, but it materialises [T, L] worth of K/V per call. This version runs
the same work items as the Pallas kernels (blocks.py: one item = one query
block of one request) and an online-softmax loop over KV pages whose trip
count is the longest item's page count, decided on device. Each iteration
gathers a few pages per item, so the live K/V is [I, K, 2, C, H] (C = KV_STEP_TOKENS)
whatever the context length, and pages past a request's length are never read.

Decode-sized batches (T <= R) use one token per item; larger batches (prefill
chunks) use BLOCK_Q tokens per item, so a chunk reads each of its pages once
per BLOCK_Q tokens instead of once per token.

Glossary: T tokens, R request rows, I items, K kv heads, G = N // K query heads
per kv head, M = block * G query rows per item, S page size, C KV tokens per
loop step, H head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.blocks import (KV_LEN, NUM_STEPS, Q_COUNT, Q_POS,
                                                          REQ, STEP_LO, gather_queries,
                                                          plan_items, scatter_outputs)
from pallas_kernels.ragged_paged_attention.cache import cache_dims

BLOCK_Q = 16
# KV tokens per loop iteration (whole pages): fewer, larger iterations amortise the
# per-iteration cost of XLA's loop on CPU; 32 measured best on the CPU benchmark.
KV_STEP_TOKENS = 32


def ragged_paged_attention(
    q: jax.Array,                 # [T, N, H]
    cache: jax.Array,             # [num_pages, K, 2, S, H]
    kv_lens: jax.Array,           # int32[R] KV length after this step
    page_table: jax.Array,        # int32[R, P]
    query_start_loc: jax.Array,   # int32[R + 1]
    num_seqs: jax.Array,          # int32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_q: int | None = None,   # tokens per item; default 1 when T <= R, else BLOCK_Q
) -> jax.Array:                   # [T, N, H]
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv, _ = cache_dims(cache)
    group = num_heads // num_kv
    num_rows, pages_per_req = page_table.shape
    block = block_q or (1 if num_tokens <= num_rows else BLOCK_Q)
    rows = block * group
    per_step = max(1, min(KV_STEP_TOKENS // page_size, pages_per_req))   # pages per iteration
    kv_step = per_step * page_size
    meta, token_item, token_row, token_valid = plan_items(
        query_start_loc, kv_lens, num_seqs, num_tokens=num_tokens, block_q=block,
        kv_step=kv_step, page_size=page_size, sliding_window=sliding_window)
    qb = gather_queries(q, meta, num_kv_heads=num_kv, block_q=block, rows=rows)
    qb = qb.astype(jnp.float32) * sm_scale                       # [I, K, M, H]
    kv_len, step_lo, num_steps = meta[:, KV_LEN], meta[:, STEP_LO], meta[:, NUM_STEPS]
    tok = jnp.arange(rows, dtype=jnp.int32) // group             # token of each query row
    row_pos = meta[:, Q_POS, None] + tok[None, :]                # [I, M]
    row_ok = tok[None, :] < meta[:, Q_COUNT, None]               # [I, M]
    item_pages = page_table[meta[:, REQ]]                        # [I, P]
    n_items = meta.shape[0]
    offsets = jnp.arange(kv_step, dtype=jnp.int32)

    def step(s, carry):
        m, l, acc = carry                                        # [I,K,M] [I,K,M] [I,K,M,H]
        active = s < num_steps                                   # [I]
        first = (step_lo + s) * per_step                         # first page of the step
        idx = jnp.clip(first[:, None] + jnp.arange(per_step)[None, :], 0, pages_per_req - 1)
        page = jnp.where(active[:, None], jnp.take_along_axis(item_pages, idx, 1), 0)
        kv = cache[page].astype(jnp.float32)                     # [I, per_step, K, 2, S, H]
        kv = kv.transpose(0, 2, 3, 1, 4, 5).reshape(n_items, num_kv, 2, kv_step, head_dim)
        slot = first[:, None] * page_size + offsets[None, :]                  # [I, C]
        slot_ok = active[:, None] & (slot < kv_len[:, None])                  # [I, C]
        mask = (slot_ok[:, None, :] & row_ok[:, :, None]
                & (slot[:, None, :] <= row_pos[:, :, None]))                  # [I, M, C]
        if sliding_window is not None:
            mask &= slot[:, None, :] > row_pos[:, :, None] - sliding_window
        scores = jnp.einsum("IKMH,IKCH->IKMC", qb, kv[:, :, 0], precision="highest")
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(mask[:, None], scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(mask[:, None], jnp.exp(scores - base[..., None]), 0.0)
        scale = jnp.where(jnp.isfinite(m), jnp.exp(m - base), 0.0)
        v = jnp.where(slot_ok[:, None, :, None], kv[:, :, 1], 0.0)          # NaN-safe select
        acc = acc * scale[..., None] + jnp.einsum("IKMC,IKCH->IKMH", p, v, precision="highest")
        return m_new, l * scale + jnp.sum(p, axis=-1), acc

    shape = qb.shape[:3]
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(qb.shape, jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, jnp.max(num_steps), step, init)
    out = (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(q.dtype)
    return scatter_outputs(out, token_item, token_row, token_valid, num_heads=num_heads,
                           block_q=block)
