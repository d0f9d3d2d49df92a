"""Ragged paged attention test batches and an independent numpy (float64) oracle.

A batch is a list of requests (q_len, kv_len), packed like the engine packs
them, padded to fixed T tokens and R rows so that one compiled kernel serves
several scenarios. Everything a request must not read is NaN: every page not
in its table (page 0 included), the slots of its last page past kv_len, the
unlisted entries of its page-table row (which point at NaN pages), and the
padding rows' pages.

With a sliding window W (make_batch(..., sliding_window=W)) a request's first new
token at position p0 sees positions p0 - W + 1 .. p0, and no token of this step
sees anything before p0 - W + 1 (its "window start"). The engine frees a sliding
layer's pages once they lie entirely before the window and does not rewrite the
page-table row, so such a row holds stale ids there (pages another request may be
writing in this very step), or the null page 0 after a prefix-cache hit. The
batches poison all of it: the page-table entries of pages entirely before the
window start point, at random, at page 0, at a NaN page, at another request's live
page (finite data: reading it unmasked gives a wrong answer, not a NaN), or past
the end of the cache (an out-of-bounds DMA, which TPU interpret mode refuses: so a
kernel that fetches such a page fails outright), and the slots of the first page
before the window start are NaN.
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


def window_start(q_len: int, kv_len: int, sliding_window: int | None) -> int:
    """The first position any new token of a request sees (0 without a window)."""
    if sliding_window is None:
        return 0
    return max(kv_len - q_len - sliding_window + 1, 0)


def make_batch(reqs, *, page_size: int, num_kv_heads: int, group: int, head_dim: int,
               dtype=jnp.float32, num_tokens: int, num_rows: int, pages_per_req: int,
               seed: int = 0, sliding_window: int | None = None) -> Batch:
    rng = np.random.default_rng(seed)
    for q_len, kv_len in reqs:
        assert 1 <= q_len <= kv_len, (q_len, kv_len)
    assert sum(q for q, _ in reqs) <= num_tokens and len(reqs) <= num_rows
    needed = [cdiv(kv, page_size) for _, kv in reqs]
    assert max(needed) < pages_per_req            # leave an unlisted entry in every row
    # Pages entirely before the window start are not the request's any more.
    lost = [window_start(q, kv, sliding_window) // page_size for q, kv in reqs]
    needed = [n - d for n, d in zip(needed, lost)]
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
        page_table[r, lost[r]:lost[r] + needed[r]] = pages
        kv_lens[r] = kv_len
        qsl[r + 1] = qsl[r] + q_len
        for pos in range(window_start(q_len, kv_len, sliding_window), kv_len):
            cache[page_table[r, pos // page_size], :, :, pos % page_size] = \
                rng.standard_normal((num_kv_heads, 2, head_dim))
    live = order[:used]
    for r in range(len(reqs)):                    # stale entries before the window
        if not lost[r]:
            continue
        stale = [0, num_pages + int(rng.integers(0, 1000)), spare[0], live[(r + 1) % len(live)]]
        page_table[r, :lost[r]] = rng.choice(stale, size=lost[r])
    qsl[len(reqs) + 1:] = qsl[len(reqs)]
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    # Round to the storage dtype so the oracle sees exactly the kernel's inputs.
    rnd = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    return Batch(rnd(q), rnd(cache.reshape(shape)), kv_lens, page_table, qsl,
                 np.array([len(reqs)], np.int32), dtype)


def oracle(b: Batch, *, sm_scale: float, sliding_window=None, soft_cap=None,
           horizon=None) -> np.ndarray:
    """float64 attention, one request and one token at a time; padding tokens -> 0.
    horizon[t]: the last position token t sees (default: its own)."""
    num_tokens, num_heads, head_dim = b.q.shape
    num_pages, kv2, page_size, _ = b.cache.shape
    num_kv = kv2 // 2
    cache = b.cache.reshape(num_pages, num_kv, 2, page_size, head_dim)   # entry 2k + kv
    group = num_heads // num_kv
    out = np.zeros((num_tokens, num_heads, head_dim))
    for r in range(int(b.num_seqs[0])):
        lo, hi, kv_len = b.query_start_loc[r], b.query_start_loc[r + 1], b.kv_lens[r]
        pos = np.arange(window_start(hi - lo, kv_len, sliding_window), kv_len)
        kv = cache[b.page_table[r, pos // page_size], :, :, pos % page_size].astype(np.float64)
        for t in range(lo, hi):
            qpos = kv_len - (hi - lo) + (t - lo)
            keep = pos <= (qpos if horizon is None else max(qpos, horizon[t]))
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


# Scenarios for a sliding window W over pages of S tokens: window starts 0, 1, on a
# page boundary and either side of it, decodes far past the window, fresh prefills
# longer than the window and chunks whose queries straddle the window's edge; each
# fits 8 rows and 128 tokens.
def window_scenarios(page_size: int, window: int) -> dict[str, list[tuple[int, int]]]:
    S, W = page_size, window
    far = max(10 * W, 8 * S) + 3
    edge = W + 2 * S                       # a decode there starts its window at 2S
    decode_lens = sorted({max(1, n) for n in (1, W - 1, W, W + 1, edge - 1, edge, edge + 1, far)})
    return {
        "decode": [(1, n) for n in decode_lens],
        "prefill": [
            (40, 40),                      # fresh: later queries' windows start past 0
            (20, edge + 25),               # first query's window starts at 2S + 6
            (13, far),
            (30, W + 25),                  # queries W - 5 .. W + 24: windows start 0 .. 25
            (9, W + S + 9),                # window start S + 1: page 0 stale, slot S NaN
            (1, W + 1),
        ],
        "mixed": [(1, far), (7, 7), (16, W + 3 * S + 16), (1, W), (25, W + 25 + S // 2),
                  (1, 1), (3, 2 * W + 5)],
    }
