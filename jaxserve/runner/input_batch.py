"""Flattens one SchedulerOutput into fixed-shape numpy arrays (a token bucket).

Arrays are preallocated at their largest size and reused every step, so the
per-step host cost is a few vectorised numpy ops plus one small loop over
the scheduled requests.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.runner.buckets import pick_bucket
from models.inputs import ModelInputs


@dataclass(frozen=True)
class HostBatch:
    inputs: ModelInputs          # numpy arrays, token bucket T, R = max_num_seqs rows
    logits_indices: np.ndarray   # int32[R] last scheduled token of each row
    num_tokens: int              # real tokens (the rest of T is padding)
    num_reqs: int


class InputBatchBuilder:
    """`page_buckets` are the page-table widths a step may use: the narrowest one that
    holds the longest request is passed, so attention that reads whole page-table
    rows (the jnp reference) reads no more context than the batch needs."""

    def __init__(self, *, max_num_seqs: int, max_model_len: int, page_size: int,
                 token_buckets: tuple[int, ...], page_buckets: tuple[int, ...] | None = None):
        self.page_size = page_size
        self.token_buckets = token_buckets
        self.pages_per_req = -(-max_model_len // page_size)
        self.page_buckets = page_buckets or (self.pages_per_req,)
        if self.page_buckets[-1] != self.pages_per_req:
            raise ValueError(f"the widest page bucket must be {self.pages_per_req}")
        t_max, r_max = token_buckets[-1], max_num_seqs
        self._token_ids = np.zeros(t_max, np.int32)
        self._positions = np.zeros(t_max, np.int32)
        self._slots = np.zeros(t_max, np.int32)
        self._qsl = np.zeros(r_max + 1, np.int32)
        self._seq_lens = np.zeros(r_max, np.int32)
        self._page_table = np.zeros((r_max, self.pages_per_req), np.int32)
        self._logits_idx = np.zeros(r_max, np.int32)
        self._state_slots = np.zeros(r_max, np.int32)

    def build(self, requests: list) -> HostBatch:
        num_reqs = len(requests)
        lens = np.fromiter((len(r.token_ids) for r in requests), np.int32, num_reqs)
        starts = np.fromiter((r.start_pos for r in requests), np.int32, num_reqs)
        num_tokens = int(lens.sum())
        t = pick_bucket(self.token_buckets, num_tokens)

        token_ids = self._token_ids[:t]
        token_ids[:] = 0
        cu = self._qsl
        cu[0] = 0
        np.cumsum(lens, out=cu[1:num_reqs + 1])
        cu[num_reqs + 1:] = num_tokens
        pt = self._page_table
        pt[:] = 0   # rows past num_reqs stay zero: no stale pages in padding rows
        state_slots = self._state_slots
        state_slots[:] = 0   # padding rows use the null state slot
        for i, r in enumerate(requests):
            token_ids[cu[i]:cu[i + 1]] = r.token_ids
            pt[i, :len(r.block_ids)] = r.block_ids
            state_slots[i] = r.state_slot

        row_of_token = np.repeat(np.arange(num_reqs, dtype=np.int32), lens)
        positions = self._positions[:t]
        positions[:] = 0
        positions[:num_tokens] = (np.arange(num_tokens, dtype=np.int32)
                                  - cu[row_of_token] + starts[row_of_token])
        slots = self._slots[:t]
        slots[:] = 0  # padding tokens write into the null page
        pos = positions[:num_tokens]
        slots[:num_tokens] = (pt[row_of_token, pos // self.page_size] * self.page_size
                              + pos % self.page_size)

        self._seq_lens[:] = 0
        self._seq_lens[:num_reqs] = starts + lens
        longest = int(self._seq_lens[:num_reqs].max(initial=1))
        width = pick_bucket(self.page_buckets, -(-longest // self.page_size))
        self._logits_idx[:] = 0
        self._logits_idx[:num_reqs] = cu[1:num_reqs + 1] - 1
        inputs = ModelInputs(
            token_ids=token_ids.copy(), positions=positions.copy(), slot_mapping=slots.copy(),
            query_start_loc=cu.copy(), seq_lens=self._seq_lens.copy(),
            page_table=pt[:, :width].copy(), num_seqs=np.array([num_reqs], np.int32),
            state_slots=state_slots.copy())
        return HostBatch(inputs, self._logits_idx.copy(), num_tokens, num_reqs)
