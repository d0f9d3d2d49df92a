"""What a step that verified drafts reads back (a mixin of runner/model_runner.ModelRunner):
each row's accepted drafts and the token after them, and the drafts its next step is to
verify (ngram prompt lookup, or the model drafter's catch-up and proposals)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from jaxserve.runner.spec_decode import ngram_propose, num_accepted
from jaxserve.runner.step_rows import ScheduledRows

if TYPE_CHECKING:   # (model_runner imports this module)
    from jaxserve.runner.model_runner import ModelRunnerOutput


class SpecCollect:
    """Reads the ModelRunner's batch, spec, drafter and params."""

    def _model_proposals(self, step: Any) -> dict[str, list[int]]:
        """The model drafter's catch-up on this step, and the drafts of the rows that
        sampled (ModelDrafter: none once more rows are held than disable_by_batch_size)."""
        rows, hb, batch = step.rows, step.hb, self.batch
        n = rows.num_tokens
        prow = rows.rows[np.repeat(np.arange(rows.num_reqs), rows.lens)]
        # Each token's next token, now that the accepted ones and the bonus are known.
        next_ids = np.zeros(len(hb.inputs.token_ids), np.int32)
        next_ids[:n] = batch.tokens[prow, hb.inputs.positions[:n] + 1]
        spec, cu = self.spec, hb.inputs.query_start_loc
        picked = np.flatnonzero(rows.sample) if spec.disable_by_batch_size is None or \
            batch.num_rows <= spec.disable_by_batch_size else np.zeros(0, np.int64)
        proposing = []
        for i in picked:
            v = int(batch.num_tokens[rows.rows[i]]) - 1     # the bonus's position
            proposing.append((int(cu[i]) + v - 1 - int(rows.starts[i]),
                              int(batch.tokens[rows.rows[i], v]), v))
        drafts = self.drafter.propose(self.params, step.hidden, hb.inputs, next_ids, proposing,
                                      batch.page_table[rows.rows[picked]])
        return {rows.req_ids[i]: d.tolist() for i, d in zip(picked, drafts)}

    def _collect_verified(self, rows: ScheduledRows, result, logprobs: bool,
                          out: ModelRunnerOutput) -> None:
        """A step whose rows verified drafts: each sampling row's window of sampler rows
        (ScheduledRows.sample_rows) -> the drafts accepted and the token after them."""
        batch, tokens = self.batch, result.token_ids
        first = 0
        for i in np.flatnonzero(rows.sample):
            row, k = rows.rows[i], int(rows.num_drafts[i])
            drawn = tokens[first:first + k + 1]
            known = batch.num_tokens[row]
            a = num_accepted(drawn, batch.tokens[row, known:known + k]) if k else 0
            new = drawn[:a + 1].tolist()
            why = batch.append_verified(row, new)
            rid = rows.req_ids[i]
            if why is not None:
                out.failed[rid] = why
            out.sampled[rid] = new if k else new[0]
            if logprobs and batch.want_logprobs[row]:
                out.logprobs[rid] = [(result.logprob_token_ids[j], result.logprobs[j],
                                      int(result.sampled_rank[j]))
                                     for j in range(first, first + a + 1)]
            first += k + 1

    def _propose(self, rows: ScheduledRows) -> dict[str, list[int]]:
        """Drafts for the rows that sampled, from their tokens (ngram prompt lookup); none
        once more rows are held than disable_by_batch_size."""
        spec, batch = self.spec, self.batch
        if spec.disable_by_batch_size is not None and batch.num_rows > spec.disable_by_batch_size:
            return {}
        out = {}
        for i in np.flatnonzero(rows.sample):
            row = rows.rows[i]
            d = ngram_propose(batch.tokens[row, :batch.num_tokens[row]], spec.prompt_lookup_min,
                              spec.prompt_lookup_max, spec.num_speculative_tokens)
            if d:
                out[rows.req_ids[i]] = d
        return out
