"""The persistent batch's sampler inputs: each step's SamplingTensors gathered from the
rows' columns (InputBatch's), laid out by sampling_tensors.pad_rows, with the rows'
token masks and logit bias (a grammar row's mask filled by its matcher)."""
from __future__ import annotations

import numpy as np

from jaxserve.runner.sampling_tensors import PARAM_COLUMNS, SamplingTensors, pad_rows
from jaxserve.runner.step_rows import ScheduledRows
from jaxserve.runner.token_constraints import ALL_ALLOWED
from jaxserve.sampling_params import MAX_LOGIT_BIAS


class BatchSampling:
    """InputBatch's sampler side (a mixin: it reads the batch's per-row columns)."""

    def sampling_tensors(self, step: ScheduledRows, num_rows_padded: int, *,
                         penalties: bool, penalty_len: int) -> SamplingTensors:
        """The sampler's per-row settings for the step's sampler rows (rows past them are
        padding), laid out by sampling_tensors.pad_rows (as make_sampling_tensors lays out
        SamplingRows). Without drafts a sampler row is a batch row; with them,
        ScheduledRows.sample_rows: the j-th position of a row's window samples output
        index (outputs so far) + j, after the drafts before it."""
        if step.num_drafts is None:
            rows, offsets, samples = step.rows, 0, step.sample
        else:
            batch_row, offsets = step.sample_rows()
            rows, samples = step.rows[batch_row], None
        # The tokens before each position (a token in flight counts: async scheduling).
        known = self.num_tokens[rows] + offsets
        if self.any_in_flight:
            known = known + (self.in_flight[rows] >= 0)
        num_out = (known - self.num_prompt[rows]).astype(np.int32)
        keys = self.keys[rows]
        unseeded = np.flatnonzero(~self.seeded[rows])
        if unseeded.size:   # not reproducible, as vLLM
            keys[unseeded] = self._rng.integers(0, 1 << 32, size=(unseeded.size, 2),
                                                dtype=np.uint64)
        banned = self.banned[rows]
        banned[num_out >= self.min_tokens[rows]] = self.vocab_size
        penalty = None
        if penalties:
            # Each row's prompt then outputs, padded with V (dropped by the sampler).
            ids = self.tokens[rows, :penalty_len]
            ids[np.arange(penalty_len)[None, :] >= known[:, None]] = self.vocab_size
            penalty = (ids, self.num_prompt[rows])
        return pad_rows(
            num_rows_padded, self.vocab_size,
            params={name: getattr(self, name) for name, _, _ in PARAM_COLUMNS},
            want_logprobs=self.want_logprobs, take=rows, keys=keys, steps=num_out, banned=banned,
            constraints=self._constraint_tensors(step, rows, samples, num_rows_padded),
            penalty=penalty)

    def _constraint_tensors(self, step: ScheduledRows, rows: np.ndarray,
                            samples: np.ndarray | None, num_rows_padded: int) -> dict:
        """token_mask and logit bias of the sampler rows (persistent `rows`; samples: which
        of them sample, None: all, each row's drafts after it): shared all-allowed /
        no-bias arrays when no row has a constraint (the common case costs no copying)."""
        free = self._free_mask.get(num_rows_padded)
        if free is None:
            free = self._free_mask[num_rows_padded] = (
                np.full((num_rows_padded, self.token_mask.shape[1]), ALL_ALLOWED, np.uint32),
                np.full((num_rows_padded, MAX_LOGIT_BIAS), self.vocab_size, np.int32),
                np.zeros((num_rows_padded, MAX_LOGIT_BIAS), np.float32))
        mask, bias_ids, bias = free
        dynamic = self.has_dynamic[rows] if samples is None else \
            self.has_dynamic[rows] & samples
        if self.has_mask[rows].any() or dynamic.any():
            mask = mask.copy()
            masked = np.flatnonzero(self.has_mask[rows])
            mask[masked] = self.token_mask[rows[masked]]
            if samples is not None:
                for i in np.flatnonzero(dynamic):
                    self.dynamic[rows[i]].fill(mask[i])
            else:
                self._fill_windows(step, mask)
        if self.has_bias[rows].any():
            bias_ids, bias = bias_ids.copy(), bias.copy()
            biased = np.flatnonzero(self.has_bias[rows])
            bias_ids[biased], bias[biased] = self.bias_ids[rows[biased]], self.bias[rows[biased]]
        return dict(token_mask=mask, logit_bias_ids=bias_ids, logit_bias=bias)

    def _fill_windows(self, step: ScheduledRows, mask: np.ndarray) -> None:
        """The dynamic masks of each sampling row's window of 1 + k sampler rows."""
        first = 0
        for i in np.flatnonzero(step.sample):
            row, k = step.rows[i], int(step.num_drafts[i])
            if self.has_dynamic[row]:
                self.dynamic[row].fill_window(
                    mask[first:first + k + 1],
                    self.tokens[row, self.num_prompt[row]:self.num_tokens[row] + k], k)
            first += k + 1
