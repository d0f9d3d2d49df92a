"""What one step hands the device, as the persistent batch lays it out: the rows it
computes (ScheduledRows), their padded inputs (HostBatch) and a hybrid's state-slot
copies."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from models.inputs import ModelInputs


@dataclass(frozen=True)
class ScheduledRows:
    """The rows one step computes, in batch order."""
    req_ids: list[str]
    rows: np.ndarray      # int32[n] persistent row of each batch row
    starts: np.ndarray    # int32[n] position of each row's first token this step
    lens: np.ndarray      # int32[n] tokens each row computes
    sample: np.ndarray    # bool[n]  the row reaches the end of its known tokens: sample one
    num_tokens: int
    # (src, dst) state-slot copies before / after the forward (SchedulerOutput's, checked).
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: int32[n] drafts each row computes after its known tokens (they
    # end its chunk); None when no row has any. A row with k drafts samples k + 1 tokens.
    num_drafts: np.ndarray | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def sample_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The sampler's rows: (batch row, position in the row's verified window: 0 at its
        last known token, j at its j-th draft) of each, int32[S]; rows that do not sample
        have none. Without drafts, one row per sampling batch row."""
        picked = np.flatnonzero(self.sample).astype(np.int32)
        if self.num_drafts is None:
            return picked, np.zeros(len(picked), np.int32)
        counts = self.num_drafts[picked] + 1
        batch_row = np.repeat(picked, counts)
        first = np.cumsum(counts) - counts
        offset = np.arange(len(batch_row), dtype=np.int32) - np.repeat(first, counts)
        return batch_row, offset.astype(np.int32)


@dataclass(frozen=True)
class HostBatch:
    inputs: ModelInputs          # numpy arrays, token bucket T, R = max_num_seqs rows
    # int32[max_sample_rows]: last scheduled token of each row (with drafts: of each
    # sampler row, ScheduledRows.sample_rows)
    logits_indices: np.ndarray
    num_tokens: int              # real tokens (the rest of T is padding)
    num_reqs: int
    # int32[T]: the index in the last step's sampled ids of each token whose id is still in
    # flight (async scheduling), -1: token_ids holds it
    token_src: np.ndarray


def state_copy_inputs(restores: list[tuple[int, int]], saves: list[tuple[int, int]],
                      k: int) -> dict[str, np.ndarray]:
    """A hybrid step's ModelInputs state-copy fields: each list of (src, dst) pairs as
    int32[k, 2] (padding rows 0) and its count int32[1]. Warmup passes empty lists."""
    out = {}
    for name, pairs in (("state_restores", restores), ("state_saves", saves)):
        a = np.zeros((k, 2), np.int32)
        if pairs:
            a[:len(pairs)] = pairs
        out[name], out["num_" + name] = a, np.array([len(pairs)], np.int32)
    return out
