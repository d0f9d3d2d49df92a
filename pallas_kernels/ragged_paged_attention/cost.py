"""The cost estimate the attention kernels give XLA (pl.CostEstimate).

A kernel's real work depends on the KV lengths, which only exist at run time,
so this is the bound the shapes allow: every query token attends to a whole
page-table row (max_model_len positions, or the sliding window), and the step
reads every page its rows can list -- at most one row per query token, so a
16-token decode bucket reads 16 rows' pages, not the whole table's -- but never
more pages than the cache holds.
For a decode step at full context that is the actual work; for shorter
contexts it is an upper bound. Without it XLA's cost analysis of a step that
calls the kernel is meaningless (the custom call counts as free).
"""
from __future__ import annotations

from jax.experimental import pallas as pl


def attention_cost(*, num_tokens: int, num_heads: int, head_dim: int, num_rows: int,
                   pages_per_req: int, page_size: int, num_pages: int, num_kv_heads: int,
                   itemsize: int, sliding_window: int | None = None) -> pl.CostEstimate:
    context = pages_per_req * page_size
    row_pages = pages_per_req
    if sliding_window is not None:
        context = min(context, sliding_window)
        row_pages = min(row_pages, -(-sliding_window // page_size) + 1)
    attended = num_tokens * context                       # (query token, kv position) pairs
    flops = 4 * head_dim * num_heads * attended           # Q K^T and P V: 2 flops per MAC
    page_bytes = 2 * num_kv_heads * page_size * head_dim * itemsize
    kv_bytes = min(min(num_rows, num_tokens) * row_pages, num_pages) * page_bytes
    q_and_out = 2 * num_tokens * num_heads * head_dim * itemsize
    table = num_rows * pages_per_req * 4
    return pl.CostEstimate(flops=flops, transcendentals=num_heads * attended,
                           bytes_accessed=kv_bytes + q_and_out + table)
