"""Pure-jnp ragged paged attention: the spec, the CPU path and the test oracle.

Cache layout: one array per layer, [2, num_pages, page_size, K, H] (K and V
stacked on the leading axis). Page 0 is the null page that padding writes to.

Glossary: T tokens, R request rows, N query heads, K kv heads, G = N // K,
H head dim, P pages per request, S page size, L = P * S context slots.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Per-block gather budget: a block of B tokens gathers [B, L, K, H] of K and V.
_GATHER_BUDGET_BYTES = 64 * 1024 * 1024


def make_kv_cache(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                  dtype=jnp.bfloat16) -> jax.Array:
    return jnp.zeros((2, num_pages, page_size, num_kv_heads, head_dim), dtype)


def write_kv(cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter k, v [T, K, H] into their slots (page * page_size + offset).

    Under jit with the cache donated this is an in-place scatter.
    """
    _, num_pages, page_size, kh, hd = cache.shape
    flat = cache.reshape(2, num_pages * page_size, kh, hd)
    kv = jnp.stack([k, v]).astype(cache.dtype)
    flat = flat.at[:, slot_mapping].set(kv, mode="drop", unique_indices=False)
    return flat.reshape(cache.shape)


def _token_metadata(query_start_loc, kv_lens, num_seqs, num_tokens):
    """For each packed token: its request row, its position in the sequence, validity."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_rows = kv_lens.shape[0]
    row = jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)
    row = jnp.minimum(row, num_rows - 1)
    valid = t < query_start_loc[num_seqs[0]]
    q_len = query_start_loc[row + 1] - query_start_loc[row]
    pos = kv_lens[row] - q_len + (t - query_start_loc[row])
    return row, pos, valid


def ragged_paged_attention(
    q: jax.Array,                 # [T, N, H]
    cache: jax.Array,             # [2, num_pages, S, K, H]
    kv_lens: jax.Array,           # int32[R] KV length after this step
    page_table: jax.Array,        # int32[R, P]
    query_start_loc: jax.Array,   # int32[R + 1]
    num_seqs: jax.Array,          # int32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:                   # [T, N, H]
    """Each token attends causally to its own request's pages.

    Tokens are processed in blocks; each token gathers its request's pages, so
    pages not in a request's table are never read. Padding tokens give zeros.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv, _ = cache.shape
    group = num_heads // num_kv
    ctx = page_table.shape[1] * page_size
    row, pos, valid = _token_metadata(query_start_loc, kv_lens, num_seqs, num_tokens)

    bytes_per_token = 2 * ctx * num_kv * head_dim * jnp.dtype(cache.dtype).itemsize
    block = num_tokens
    while block > 1 and block * bytes_per_token > _GATHER_BUDGET_BYTES and num_tokens % (block // 2) == 0:
        block //= 2
    nblk = num_tokens // block

    def attend(args):
        qb, rb, pb, vb = args                                   # [B,N,H], [B], [B], [B]
        pages = page_table[rb]                                   # [B, P]
        kv = cache[:, pages].reshape(2, block, ctx, num_kv, head_dim)
        qg = qb.reshape(block, num_kv, group, head_dim).astype(jnp.float32)
        s = jnp.einsum("BKGH,BLKH->BKGL", qg, kv[0].astype(jnp.float32)) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        slot = jnp.arange(ctx, dtype=jnp.int32)[None, :]
        mask = (slot <= pb[:, None]) & (slot < kv_lens[rb][:, None]) & vb[:, None]
        if sliding_window is not None:
            mask &= slot > pb[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
        p = jnp.where(mask[:, None, None, :], p, 0.0)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("BKGL,BLKH->BKGH", p / jnp.where(denom > 0, denom, 1.0),
                       kv[1].astype(jnp.float32))
        return o.reshape(block, num_heads, head_dim).astype(q.dtype)

    split = lambda x: x.reshape(nblk, block, *x.shape[1:])
    out = jax.lax.map(attend, (split(q), split(row), split(pos), split(valid)))
    return out.reshape(num_tokens, num_heads, head_dim)
