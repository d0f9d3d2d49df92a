"""The cost estimate the attention kernels give XLA (pl.CostEstimate).

A kernel's real work depends on the KV lengths, which only exist at run time,
so this is the bound the shapes allow: every query token attends to a whole
page-table row (max_model_len positions), or with a sliding window W to at most
W positions; the step reads every page its rows can list -- at most one row per
query token, so a 16-token decode bucket reads 16 rows' pages, not the whole
table's -- but never more pages than the cache holds. With a window a row reads
only the pages its tokens' windows cover: a row with q new tokens spans at most
W - 1 + q positions, cdiv(W - 2 + q, S) + 1 pages (pages entirely before the
window are never fetched, blocks.py), so a decode row reads about W / S pages
and a prefill chunk W / S more than its own.
For a decode step at full context that is the actual work; for shorter
contexts it is an upper bound. Pages are counted once per row: a prefill chunk
cut into several work items re-reads its shared pages once per item, which is
not counted. Without it XLA's cost analysis of a step that calls the kernel is
meaningless (the custom call counts as free).
"""
from __future__ import annotations

from jax.experimental import pallas as pl


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pages_read(*, num_tokens: int, num_rows: int, pages_per_req: int, page_size: int,
               num_pages: int, sliding_window: int | None = None) -> int:
    """The most pages one step can read (see the module doc)."""
    rows = min(num_rows, num_tokens)
    pages = rows * pages_per_req
    if sliding_window is not None:
        # Row r (q_r tokens, sum q_r <= T) spans <= cdiv(W - 1, S) + 1 + cdiv(q_r - 1, S)
        # pages; the sum of the last terms over the rows is at most
        # cdiv(T - rows, S) + (the number of rows with q_r > 1, <= min(rows, T - rows)).
        extra = num_tokens - rows
        per_window = _cdiv(sliding_window - 1, page_size) + 1
        pages = min(pages, rows * per_window + _cdiv(extra, page_size) + min(rows, extra))
    return min(pages, num_pages)


def attention_cost(*, num_tokens: int, num_heads: int, head_dim: int, num_rows: int,
                   pages_per_req: int, page_size: int, num_pages: int, num_kv_heads: int,
                   itemsize: int, sliding_window: int | None = None) -> pl.CostEstimate:
    context = pages_per_req * page_size
    if sliding_window is not None:
        context = min(context, sliding_window)
    attended = num_tokens * context                       # (query token, kv position) pairs
    flops = 4 * head_dim * num_heads * attended           # Q K^T and P V: 2 flops per MAC
    page_bytes = 2 * num_kv_heads * page_size * head_dim * itemsize
    kv_bytes = pages_read(num_tokens=num_tokens, num_rows=num_rows, pages_per_req=pages_per_req,
                          page_size=page_size, num_pages=num_pages,
                          sliding_window=sliding_window) * page_bytes
    q_and_out = 2 * num_tokens * num_heads * head_dim * itemsize
    table = num_rows * pages_per_req * 4
    return pl.CostEstimate(flops=flops, transcendentals=num_heads * attended,
                           bytes_accessed=kv_bytes + q_and_out + table)
