"""Ragged paged attention test batches and an independent numpy (float64) oracle.

A batch is a list of requests (q_len, kv_len), packed like the engine packs
them, padded to fixed T tokens and R rows so that one compiled kernel serves
several scenarios. Everything a request must not read is NaN: every page not
in its table (page 0 included), the slots of its last page past kv_len, the
unlisted entries of its page-table row (which point at NaN pages), and the
padding rows' pages.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import make_kv_cache


@dataclasses.dataclass
class Batch:
    q: np.ndarray                 # [T, N, H] float32 (already rounded to dtype)
    cache: np.ndarray             # [num_pages, 2K, S, H] float32 (rounded, NaN where unused)
    kv_lens: np.ndarray
    page_table: np.ndarray
    query_start_loc: np.ndarray
    num_seqs: np.ndarray
    dtype: object

    def args(self):
        dt = self.dtype
        return (jnp.asarray(self.q, dt), jnp.asarray(self.cache, dt), jnp.asarray(self.kv_lens),
                jnp.asarray(self.page_table), jnp.asarray(self.query_start_loc),
                jnp.asarray(self.num_seqs))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_batch(reqs, *, page_size: int, num_kv_heads: int, group: int, head_dim: int,
               dtype=jnp.float32, num_tokens: int, num_rows: int, pages_per_req: int,
               seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    for q_len, kv_len in reqs:
        assert 1 <= q_len <= kv_len, (q_len, kv_len)
    assert sum(q for q, _ in reqs) <= num_tokens and len(reqs) <= num_rows
    needed = [cdiv(kv, page_size) for _, kv in reqs]
    assert max(needed) < pages_per_req            # leave an unlisted entry in every row
    num_pages = 1 + sum(needed) + 4               # page 0 and a few spare pages stay NaN
    shape = make_kv_cache(num_pages, page_size, num_kv_heads, head_dim, dtype).shape
    cache = np.full((num_pages, num_kv_heads, 2, page_size, head_dim), np.nan, np.float32)
    order = rng.permutation(np.arange(1, num_pages))          # pages in random order
    spare = order[sum(needed):]
    page_table = rng.choice(np.append(spare, 0), size=(num_rows, pages_per_req)).astype(np.int32)
    kv_lens = rng.integers(1, 9, num_rows).astype(np.int32)   # padding rows: garbage
    qsl = np.zeros(num_rows + 1, np.int32)
    used = 0
    for r, (q_len, kv_len) in enumerate(reqs):
        pages = order[used:used + needed[r]]
        used += needed[r]
        page_table[r, :needed[r]] = pages
        kv_lens[r] = kv_len
        qsl[r + 1] = qsl[r] + q_len
        for pos in range(kv_len):
            cache[pages[pos // page_size], :, :, pos % page_size] = \
                rng.standard_normal((num_kv_heads, 2, head_dim))
    qsl[len(reqs) + 1:] = qsl[len(reqs)]
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    # Round to the storage dtype so the oracle sees exactly the kernel's inputs.
    rnd = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    return Batch(rnd(q), rnd(cache.reshape(shape)), kv_lens, page_table, qsl,
                 np.array([len(reqs)], np.int32), dtype)


def oracle(b: Batch, *, sm_scale: float, sliding_window=None, soft_cap=None) -> np.ndarray:
    """float64 attention, one request and one token at a time; padding tokens -> 0."""
    num_tokens, num_heads, head_dim = b.q.shape
    num_pages, kv2, page_size, _ = b.cache.shape
    num_kv = kv2 // 2
    cache = b.cache.reshape(num_pages, num_kv, 2, page_size, head_dim)   # entry 2k + kv
    group = num_heads // num_kv
    out = np.zeros((num_tokens, num_heads, head_dim))
    for r in range(int(b.num_seqs[0])):
        lo, hi, kv_len = b.query_start_loc[r], b.query_start_loc[r + 1], b.kv_lens[r]
        pos = np.arange(kv_len)
        kv = cache[b.page_table[r, pos // page_size], :, :, pos % page_size].astype(np.float64)
        for t in range(lo, hi):
            qpos = kv_len - (hi - lo) + (t - lo)
            keep = pos <= qpos
            if sliding_window is not None:
                keep &= pos > qpos - sliding_window
            for n in range(num_heads):
                k, v = kv[keep, n // group, 0], kv[keep, n // group, 1]
                s = k @ b.q[t, n].astype(np.float64) * sm_scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                p = np.exp(s - s.max())
                out[t, n] = p @ v / p.sum()
    return out


def tolerance(dtype) -> dict:
    return dict(atol=1e-5, rtol=1e-5) if jnp.dtype(dtype) == jnp.float32 else dict(atol=2e-2, rtol=2e-2)


# Scenarios for page size S; each fits 8 rows and 128 tokens (a prefill of S-1, S and
# S+1 tokens only while that fits).
def scenarios(page_size: int, long: int = 300) -> dict[str, list[tuple[int, int]]]:
    S = page_size
    lens = [1, S - 1, S, S + 1, long]
    return {
        "decode": [(1, n) for n in lens],
        "prefill": ([(1, 1), (S - 1, S - 1), (S, S), (S + 1, S + 1), (25, 25)] if S <= 24
                    else [(1, 1), (31, 31), (40, 40), (50, 50)]),
        # decodes, a fresh prefill and prefix-cached chunks (q_len < kv_len) together
        "mixed": [(1, S + 1), (7, 7), (5, long), (1, 1), (20, S + 20), (1, S), (3, S - 1)],
    }
