"""Requests whose prefix hit is restored a step ahead (a mixin of Scheduler;
docs/TIERED_CACHE.md).

A hit with a host part (or over pages that the step being scheduled restores into) is
taken in step k with its pages, state slot and LoRA slot, but no tokens: the runner
sends the host rows to the device in step k and scatters them into the pages at the
start of step k+1, so step k's forward never waits for the transfer. The request
waits in `restoring` (neither running nor waiting) and, in step k+1, is scheduled
first among the new rows, from its hit on. One that does not fit then (no budget, no
pages, a preemption in that step, its device snapshot gone) goes back to the front of
the queue with its pages freed: they keep their hashes, so its next look-up finds them
on the device.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from jaxserve.core.step_draft import StepDraft


class Restoring:
    """Needs the scheduler's kv, running, restoring (request id -> request, in the order
    they were taken), _fit_chunk, _admit, _push_waiting and the LoRA slots."""

    def _park(self, req: Request, num_hit: int) -> None:
        """req's hit (num_hit tokens, its pages taken) is restored in this step."""
        req.num_computed_tokens = num_hit
        req.status = RequestStatus.RUNNING
        self.restoring[req.request_id] = req

    def _schedule_restoring(self, step: StepDraft) -> None:
        """The requests taken last step: each computes its first chunk now, or goes back
        to the queue."""
        back = []
        for req in list(self.restoring.values()):
            del self.restoring[req.request_id]
            fit = None
            if not step.preempted and step.budget > 0 and self.kv.resume(req):
                fit = self._fit_chunk(req, req.num_computed_tokens, step.budget)
            if fit is None:
                back.append(req)
                continue
            num_new, images = fit
            step.budget -= num_new
            self._admit(req, step, req.num_computed_tokens, num_new, images)
        for req in reversed(back):
            self._unpark(req)

    def _unpark(self, req: Request) -> None:
        """Back to the front of the queue, its pages and slots given back (a restore
        already sent still fills its pages: they keep their hashes)."""
        self.restoring.pop(req.request_id, None)
        self._drop_lora_slot(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self._push_waiting(req, front=True)

    def _unpark_all(self) -> None:
        """A step failed: whatever waits for its restores looks up again."""
        for req in reversed(list(self.restoring.values())):
            self._unpark(req)
