"""The scheduler's part in speculative decoding (a mixin of Scheduler): how many drafts a
step verifies, the pages a model drafter writes ahead, and a verified row's tokens."""
from __future__ import annotations

from jaxserve.core.request import Request
from jaxserve.core.sched_output import SchedulerOutput
from jaxserve.core.stopping import check_stop


class SpecDecodeScheduling:
    """Reads the Scheduler's num_lookahead_tokens, max_len, kv and spec counters."""

    def _lookahead(self, req: Request, end: int) -> int:
        """Positions past `end` (where the request's chunk ends) to allocate pages for."""
        if not self.num_lookahead_tokens or end < req.num_tokens:
            return 0
        return max(min(self.num_lookahead_tokens, self.max_len - end), 0)

    def _num_drafts(self, req: Request, budget: int) -> int:
        """How many of the request's drafts a step can verify: within the step's budget,
        the model length and its max_tokens (the token sampled after them counts too)."""
        n = min(len(req.spec_token_ids), budget, self.max_len - 1 - req.num_tokens)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            n = min(n, max_tokens - req.num_output_tokens - 1)
        return max(n, 0)

    def _append_verified(self, req: Request, tokens: list[int],
                         scheduler_output: SchedulerOutput) -> bool:
        """A row that verified drafts: its accepted drafts and the token after them, each
        checked for a stop (what follows a stop is dropped). The rejected drafts' KV
        positions count as not computed (they are written over); a hybrid's state goes
        back to its backup and the accepted tokens are computed again. -> stopped."""
        drafts = scheduler_output.spec_token_ids.get(req.request_id, ())
        accepted = len(tokens) - 1
        if accepted > len(drafts) or tokens[:accepted] != drafts[:accepted]:
            raise ValueError(f"request {req.request_id!r}: the runner accepted {tokens} "
                             f"for drafts {drafts}")
        if drafts:
            self.spec_num_drafts += 1
            self.spec_num_draft_tokens += len(drafts)
            per_pos = self.spec_accepted_per_pos
            for j in range(accepted):
                per_pos[j] += 1
        rejected = len(drafts) - accepted
        if rejected and self.kv.spec_backups:
            c = scheduler_output.cached_reqs
            req.num_computed_tokens = c.num_computed_tokens[c.req_ids.index(req.request_id)]
            self.kv.rollback_state(req)
        else:
            req.num_computed_tokens -= rejected
        for tok in tokens:
            req.append_output_token_ids(tok)
            self.num_generation_tokens += 1
            if check_stop(req, tok, self.max_len):
                return True
        if rejected and self.kv.spec_backups:   # all but the token sampled last, again
            self.spec_num_recomputed_tokens += req.num_tokens - 1 - req.num_computed_tokens
        return False
