"""Pure-jnp ragged paged attention: the spec, the CPU path and the test oracle.

Semantics: the packed queries q [T, N, H] hold the new tokens of requests
0..num_seqs-1, request r owning tokens query_start_loc[r]:query_start_loc[r+1]
(its last q_len positions: kv_lens[r] - q_len .. kv_lens[r] - 1; their K/V are
already in the cache). Each token attends causally to its own request's
positions, optionally only to the last `sliding_window` of them, with scores
sm_scale * q.k, soft-capped as soft_cap * tanh(s / soft_cap). horizon (int32[T],
optional) lets a token see later positions of its request up to horizon[t] (Gemma 4's
image tokens see their whole image; the window still bounds the past side); the
default is its own position. Tokens past
query_start_loc[num_seqs] are padding and give zeros.

Only the first cdiv(kv_lens[r], S) entries of page_table[r] are request r's
pages; anything past them (and any slot past kv_lens[r]) may hold garbage or
NaN and must not reach the output, so masked scores and masked V rows are
selected away (a select, never a multiply by zero). With a sliding window the
same holds before the window: the entries of pages that lie entirely before
the window of the request's first new token may be stale ids (pages freed and
reused by other requests, possibly written in the same step) or the null page,
and slots before that window start may hold anything. No impl fetches such a
page (here: page 0 is gathered in its place).

Glossary: T tokens, R request rows, N query heads, K kv heads, G = N // K,
H head dim, P pages per request, S page size, L = P * S context slots.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.held_dtypes import as_values
from pallas_kernels.ragged_paged_attention.cache import cache_dims
from pallas_kernels.sorted_search import bucket_of

# Per-block gather budget: a block of B tokens gathers [B, K, 2, L, H] of K and V.
_GATHER_BUDGET_BYTES = 64 * 1024 * 1024


def token_metadata(query_start_loc: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array,
                   num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each packed token: its request row, its position in the sequence, validity."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_rows = kv_lens.shape[0]
    row = bucket_of(query_start_loc[1:], t)
    row = jnp.minimum(row, num_rows - 1)
    valid = t < query_start_loc[num_seqs[0]]
    q_len = query_start_loc[row + 1] - query_start_loc[row]
    pos = kv_lens[row] - q_len + (t - query_start_loc[row])
    return row, pos, valid


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
    horizon: jax.Array | None = None,   # int32[T] the last position each token sees
) -> jax.Array:                   # [T, N, H]
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv, _ = cache_dims(cache)
    cache = cache.reshape(num_pages, num_kv, 2, page_size, head_dim)   # the same bytes
    group = num_heads // num_kv
    num_pages_per_req = page_table.shape[1]
    ctx = num_pages_per_req * page_size
    row, pos, valid = token_metadata(query_start_loc, kv_lens, num_seqs, num_tokens)
    last = pos if horizon is None else jnp.maximum(horizon, pos)

    bytes_per_token = 2 * ctx * num_kv * head_dim * jnp.dtype(cache.dtype).itemsize
    block = num_tokens
    while block > 1 and block * bytes_per_token > _GATHER_BUDGET_BYTES and num_tokens % (block // 2) == 0:
        block //= 2
    nblk = num_tokens // block

    def attend(args):
        qb, rb, pb, hb, vb = args                               # [B,N,H], [B], [B], [B], [B]
        kv_len = kv_lens[rb]                                    # [B]
        # Unlisted page slots point at page 0; whatever they hold is selected away below.
        page_no = jnp.arange(num_pages_per_req)[None, :]
        listed = page_no * page_size < kv_len[:, None]
        if sliding_window is not None:
            # Pages entirely before the token's window may be stale (freed, reused by
            # another request): never gather them (page 0 instead, masked like the rest).
            listed &= (page_no + 1) * page_size > (pb - (sliding_window - 1))[:, None]
        pages = jnp.where(listed, page_table[rb], 0)           # [B, P]
        kv = as_values(cache[pages])                            # [B, P, K, 2, S, H]
        kv = kv.transpose(0, 3, 2, 1, 4, 5).reshape(block, 2, num_kv, ctx, head_dim)
        slot = jnp.arange(ctx, dtype=jnp.int32)[None, :]
        mask = (slot <= hb[:, None]) & (slot < kv_len[:, None]) & vb[:, None]   # [B, L]
        if sliding_window is not None:
            mask &= slot > pb[:, None] - sliding_window
        k = kv[:, 0].astype(jnp.float32)                        # [B, K, L, H]
        v = jnp.where(mask[:, None, :, None], kv[:, 1].astype(jnp.float32), 0.0)
        qg = qb.reshape(block, num_kv, group, head_dim).astype(jnp.float32)
        s = jnp.einsum("BKGH,BKLH->BKGL", qg, k, precision="highest") * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
        p = jnp.where(mask[:, None, None, :], p, 0.0)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("BKGL,BKLH->BKGH", p / jnp.where(denom > 0, denom, 1.0), v,
                       precision="highest")
        return o.reshape(block, num_heads, head_dim).astype(q.dtype)

    split = lambda x: x.reshape(nblk, block, *x.shape[1:])
    out = jax.lax.map(attend, (split(q), split(row), split(pos), split(last), split(valid)))
    return out.reshape(num_tokens, num_heads, head_dim)
