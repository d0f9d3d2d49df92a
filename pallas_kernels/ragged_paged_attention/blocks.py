"""Work items shared by the kernels: one item = one query block of one request.

A request with q_len new tokens is cut into cdiv(q_len, BQ) blocks of BQ
tokens; every block becomes an item, and a kernel program handles one item
(for one or all kv heads) with an online-softmax loop over the KV steps the
item needs. Decodes are items with one token; a long prefill chunk is many.
The item count is bounded statically by min(T, cdiv(T, BQ) + R); items past
the real count have NUM_STEPS = 0 and are skipped.

The queries of an item are laid out as a dense [M, H] tile per kv head,
row m = t * G + g (token t of the block, query head g of the group), padded
to M rows, so the kernels never see ragged shapes; gather_queries builds the
[I, K, M, H] tiles and scatter_outputs puts the result rows back in [T, N, H].

Per-item metadata (int32[I, NUM_FIELDS]) is computed here in XLA, once per
call, so the kernels only read scalars.

KV steps. Step s of an item covers the KV positions KV_LO + s * kv_step ..
KV_LO + (s + 1) * kv_step - 1. KV_LO is the first position any query of the
item may attend to (0, or with a sliding window W the first query's window
start q_pos - W + 1) rounded down to the fetch granularity min(page_size,
kv_step) -- a whole page when steps hold whole pages -- and NOT to a multiple
of kv_step: so no step fetches a page that lies entirely before the item's
window. Such pages may have been freed and reused by another request (the
page-table row still holds their stale ids) or be the null page after a
prefix-cache hit; their contents may be anything, and another request may be
writing them in the same step. The slots of the first page before the window
start belong to the request but are never needed: the kernels select them
away like slots past KV_LEN (window_start below).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.sorted_search import bucket_of

# Fields of the per-item metadata.
REQ, Q_START, Q_COUNT, Q_POS, KV_LEN, KV_LO, NUM_STEPS, NUM_PAGES, NUM_ITEMS = range(9)
NUM_FIELDS = 9     # NUM_ITEMS (the real item count) is the same in every row


def max_items(num_tokens: int, num_rows: int, block_q: int) -> int:
    return max(1, min(num_tokens, -(-num_tokens // block_q) + num_rows))


def plan_items(query_start_loc: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, *,
               num_tokens: int, block_q: int, kv_step: int, page_size: int,
               sliding_window: int | None, row_mask: jax.Array | None = None,
               num_items: int | None = None, horizon: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """-> (meta int32[I, NUM_FIELDS], token_item int32[T], token_row int32[T], token_valid bool[T]).

    kv_step is the kernel's KV block in tokens: an item loops over NUM_STEPS
    steps from position KV_LO (see the module doc), up to the step holding its
    last query's position (causal, and the window when given). kv_step and
    page_size must be multiples of one another.
    row_mask (bool[R]) plans only those rows: the others get no items and their
    tokens are invalid. num_items overrides the static item count I when the
    caller knows a smaller bound (e.g. R for one-token rows with block_q = 1).
    horizon (int32[T]): the last position each token sees, when some see past their own
    (the item's steps then reach its tokens' largest horizon).
    """
    num_rows = kv_lens.shape[0]
    n_items = num_items or max_items(num_tokens, num_rows, block_q)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    live = rows < num_seqs[0]
    if row_mask is not None:
        live &= row_mask
    q_start_row = query_start_loc[:-1]
    q_len = jnp.where(live, query_start_loc[1:] - q_start_row, 0)
    kv_len_row = jnp.where(live, kv_lens, 0)
    blocks = -(-q_len // block_q)                                 # items per request
    ends = jnp.cumsum(blocks)                                     # [R]
    firsts = ends - blocks

    i = jnp.arange(n_items, dtype=jnp.int32)
    req = jnp.minimum(bucket_of(ends, i), num_rows - 1)
    valid = i < ends[-1]
    j = i - firsts[req]                                           # block index within its request
    q_start = q_start_row[req] + j * block_q
    q_count = jnp.clip(q_len[req] - j * block_q, 0, block_q)
    kv_len = kv_len_row[req]
    q_pos = kv_len - q_len[req] + j * block_q                    # position of the block's first token
    last_pos = q_pos + q_count - 1
    if horizon is not None:   # the block's tokens' largest horizon (its own positions at least)
        tok = q_start[:, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :]
        seen = jnp.where(jnp.arange(block_q)[None, :] < q_count[:, None],
                         horizon[jnp.minimum(tok, num_tokens - 1)], 0)
        last_pos = jnp.maximum(last_pos, jnp.max(seen, axis=1))
    if kv_step % page_size and page_size % kv_step:
        raise ValueError(f"kv_step {kv_step} and page_size {page_size}: one must divide the other")
    grain = min(kv_step, page_size)
    kv_lo = jnp.zeros_like(q_pos) if sliding_window is None else \
        jnp.maximum(window_start(q_pos, sliding_window), 0) // grain * grain
    num_steps = jnp.where(valid & (q_count > 0), (last_pos - kv_lo) // kv_step + 1, 0)
    num_pages = -(-kv_len // page_size)
    meta = jnp.stack([req, q_start, q_count, q_pos, kv_len, kv_lo, num_steps, num_pages], axis=1)
    meta = jnp.where(valid[:, None], meta, 0)
    meta = jnp.concatenate([meta, jnp.broadcast_to(ends[-1], (n_items, 1))], axis=1).astype(jnp.int32)

    # Each real token belongs to exactly one item.
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    t_req = jnp.minimum(bucket_of(query_start_loc[1:], t),
                        num_rows - 1)
    t_valid = (t < query_start_loc[num_seqs[0]]) & live[t_req]
    within = t - q_start_row[t_req]
    token_item = jnp.where(t_valid, firsts[t_req] + within // block_q, 0)
    token_row = jnp.where(t_valid, within % block_q, 0)
    return meta, token_item.astype(jnp.int32), token_row.astype(jnp.int32), t_valid


def window_start(q_pos: jax.Array, sliding_window: int) -> jax.Array:
    """The first KV position the query at q_pos sees with a sliding window (may be < 0)."""
    return q_pos - (sliding_window - 1)


def gather_queries(q: jax.Array, meta: jax.Array, *, num_kv_heads: int, block_q: int,
                   rows: int) -> jax.Array:
    """q [T, N, H] -> [I, K, rows, H]; row t * G + g holds token t, head g (rest zero)."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    n_items = meta.shape[0]
    tok = jnp.minimum(meta[:, Q_START, None] + jnp.arange(block_q, dtype=jnp.int32), num_tokens - 1)
    qb = q.reshape(num_tokens, num_kv_heads, group, head_dim)[tok]     # [I, BQ, K, G, H]
    qb = qb.transpose(0, 2, 1, 3, 4).reshape(n_items, num_kv_heads, block_q * group, head_dim)
    return jnp.pad(qb, ((0, 0), (0, 0), (0, rows - block_q * group), (0, 0)))


def row_horizons(meta: jax.Array, horizon: jax.Array, *, group: int, rows: int) -> jax.Array:
    """int32[I, rows]: the last KV position each query row of an item sees -- its token's
    horizon (int32[T], plan_items), at least the token's own position. Row m is token
    m // G of the item as gather_queries lays them out; padding rows copy the last real
    token's, as the kernels' positional masks do."""
    tok = jnp.arange(rows, dtype=jnp.int32)[None, :] // group
    tok = jnp.minimum(tok, jnp.maximum(meta[:, Q_COUNT, None] - 1, 0))              # [I, rows]
    pos = meta[:, Q_POS, None] + tok
    seen = horizon[jnp.minimum(meta[:, Q_START, None] + tok, horizon.shape[0] - 1)]
    return jnp.maximum(pos, seen).astype(jnp.int32)


def scatter_outputs(out_blocks: jax.Array, token_item: jax.Array, token_row: jax.Array,
                    token_valid: jax.Array, *, num_heads: int, block_q: int) -> jax.Array:
    """[I, K, rows, H] -> [T, N, H]; padding tokens get zeros."""
    n_items, num_kv_heads, _, head_dim = out_blocks.shape
    group = num_heads // num_kv_heads
    ob = out_blocks[:, :, :block_q * group].reshape(n_items, num_kv_heads, block_q, group, head_dim)
    out = ob[token_item, :, token_row]                                   # [T, K, G, H]
    out = jnp.where(token_valid[:, None, None, None], out, 0)
    return out.reshape(token_item.shape[0], num_heads, head_dim)
