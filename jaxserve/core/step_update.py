"""The scheduler's update from a step's results (a mixin of core/scheduler.Scheduler):
the sampled tokens appended, stop conditions applied, finished requests freed.

Async scheduling (engine/async_scheduling.py) updates from step N after step N+1 was
scheduled: whether a row sampled is decided from the step's own row (a later step has
advanced num_computed_tokens), a request preempted meanwhile keeps its token (it is real),
and each request's num_in_flight counts the tokens sampled and not yet appended."""
from __future__ import annotations

from typing import Container

from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sched_output import SchedulerOutput
from jaxserve.core.stopping import check_stop


class StepUpdate:
    """Reads the Scheduler's requests, running, waiting, kv, max_len and counters."""

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, int | list[int]],
        proposals: dict[str, list[int]] | None = None, failed: Container[str] = (),
    ) -> list[Request]:
        """Append sampled tokens, apply stop conditions, free finished
        requests. Returns the requests that got a token (finished or not).
        A row that verified drafts gets a list: the drafts accepted, then the token
        sampled after them. proposals: the drafts each request is to verify next.
        failed: requests whose constraint failed on this step's tokens: they finish
        with FINISHED_ERROR, whatever else would have stopped them."""
        out: list[Request] = []
        finished_any = False
        running_status = RequestStatus.RUNNING
        if self.kv.snapshots is not None:   # the step ran: its snapshots are taken
            self.kv.snapshots.commit()
        if self.kv.host is not None:   # its offloads landed, its restores were read
            self.kv.host.commit()
        requests, preempted = self.requests, RequestStatus.PREEMPTED
        for rid, start, num_new in scheduler_output.scheduled():
            req = requests.get(rid)
            if req is None:
                continue  # finished or aborted since it was scheduled
            # (the step's own row: a later step may have advanced num_computed_tokens)
            if start + num_new < req.num_tokens:
                continue  # a prefill chunk short of the end: nothing sampled
            status = req.status
            if status != running_status and status != preempted:
                continue
            req.num_in_flight -= 1
            # Preempted by a later step while this one ran (async scheduling): its token
            # is real and kept; it resumes with it.
            if not req.output_token_ids:   # its prompt is done
                self.num_prompt_tokens += req.num_prompt_tokens
            if req.sampling_params.max_tokens == 0:
                # Prompt scoring: done once the prompt is computed (its logprobs came
                # with this step); the token the runner sampled anyway is not kept.
                if status == preempted:
                    self.waiting.remove(req)
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self._release(req)
                finished_any = True
                out.append(req)
                continue
            tok = sampled.get(rid)
            if tok is None:  # it would never be scheduled again
                raise ValueError(f"no sampled token for running request {rid!r}")
            if type(tok) is not int:
                stopped = self._append_verified(req, tok, scheduler_output)
            elif rid in scheduler_output.spec_token_ids:
                raise ValueError(f"request {rid!r} verified drafts: the runner must answer "
                                 f"with a list of tokens, got {tok!r}")
            else:
                req.append_output_token_ids(tok)
                self.num_generation_tokens += 1
                stopped = check_stop(req, tok, self.max_len)
            if failed and rid in failed:
                req.status, req.stop_reason = RequestStatus.FINISHED_ERROR, None
                stopped = True
            if stopped:
                if status == preempted:
                    self.waiting.remove(req)
                self._release(req)
                finished_any = True
            elif proposals is not None:
                req.spec_token_ids = proposals.get(rid, [])
            out.append(req)
        if finished_any:
            self.running = [r for r in self.running if r.status == running_status]
        return out

    def _ends_in_flight(self, req: Request) -> bool:
        """Whether the tokens in flight end the request by length (max_tokens, the model
        length): then no step computes past them."""
        n = req.num_in_flight
        max_tokens = req.sampling_params.max_tokens
        return ((max_tokens is not None and req.num_output_tokens + n >= max_tokens)
                or req.num_tokens + n >= self.max_len)
