"""Continuous-batching scheduler: decides which tokens of which requests the
next device step computes. Host only; hands the runner a SchedulerOutput."""

from __future__ import annotations

from collections import deque
from typing import Iterable

from jaxserve.core.encoder_cache import EncoderCache
from jaxserve.core.host_cache import HostCache
from jaxserve.core.kv_cache_manager import GroupPages, KVCacheManager
from jaxserve.core.lora_slots import LoRASlotManager, SchedulerLoRA
from jaxserve.core.restoring import Restoring
from jaxserve.core.spec_scheduling import SpecScheduling
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxserve.core.scheduler_config import SchedulerConfig
from jaxserve.core.scheduler_stats import SchedulerStats
from jaxserve.core.step_draft import StepDraft as _StepDraft
from jaxserve.core.step_update import StepUpdate
from jaxserve.core.waiting_queue import PriorityQueue

__all__ = ["CachedRequestData", "NewRequestData", "Scheduler", "SchedulerConfig",
           "SchedulerOutput", "SchedulerStats"]


class Scheduler(SchedulerLoRA, SpecScheduling, StepUpdate, Restoring):
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = c = config
        self.page_size = c.page_size
        self.max_num_seqs = c.max_num_seqs
        self.max_num_batched_tokens = c.max_num_batched_tokens
        self.max_model_len = c.max_model_len
        self.max_len = c.max_len
        self.policy = c.policy
        self.num_speculative_tokens = c.num_speculative_tokens
        self.num_lookahead_tokens = c.num_lookahead_tokens
        self.kv = KVCacheManager(c.num_pages, c.page_size, c.enable_prefix_caching,
                                 c.num_state_slots, num_sliding_pages=c.num_sliding_pages,
                                 sliding_window=c.sliding_window,
                                 num_snapshot_slots=c.num_snapshot_slots,
                                 spec_backups=c.num_speculative_tokens > 0,
                                 drop_last_hit_page=c.drop_last_hit_page,
                                 host=HostCache.for_config(c), whole_images=c.whole_images)
        self.lora = LoRASlotManager(c.max_loras) if c.max_loras else None
        # Vision-language models serving images: which embeddings the runner holds.
        self.encoder = EncoderCache(c.encoder_cache_rows, c.encoder_budget, c.whole_images) \
            if c.encoder_cache_rows else None
        self.requests: dict[str, Request] = {}  # unfinished only
        self.running: list[Request] = []
        # Taken with a hit restored this step; computed from the next (core/restoring.py).
        self.restoring: dict[str, Request] = {}
        self.waiting: deque[Request] | PriorityQueue = (
            deque() if c.policy == "fcfs" else PriorityQueue()
        )
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0       # see SchedulerStats
        self.num_generation_tokens = 0
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_accepted_per_pos = [0] * c.num_speculative_tokens
        # Hybrids: accepted tokens computed again after a rejection rolled the state back.
        self.spec_num_recomputed_tokens = 0

    # ---- requests in and out -------------------------------------------

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        if request.page_size != self.page_size:
            raise ValueError(
                f"request {rid!r} hashes pages of {request.page_size} tokens, "
                f"the scheduler uses {self.page_size}"
            )
        if request.num_tokens > self.max_len:
            raise ValueError(
                f"request {rid!r} has {request.num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len} or the {self.kv.num_pages - 1} "
                f"pages of {self.page_size} tokens in the KV pool"
            )
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self._push_waiting(request)

    def finish_requests(
        self,
        req_ids: str | Iterable[str],
        status: RequestStatus,
        stop_reason: int | str | None = None,
    ) -> list[Request]:
        """Finish requests now (abort, stop string, ...): free their pages and
        drop them from the queues. Unknown or finished ids are ignored."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status must be a finished status, got {status!r}")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        done = []
        leave_running = set()
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if rid in self.restoring:
                del self.restoring[rid]
            elif req.status == RequestStatus.RUNNING:
                leave_running.add(rid)
            else:
                self.waiting.remove(req)
            req.status = status
            req.stop_reason = stop_reason
            self._release(req)
            done.append(req)
        if leave_running:
            self.running = [r for r in self.running if r.request_id not in leave_running]
        return done

    def abort_requests(self, req_ids: str | Iterable[str]) -> list[Request]:
        return self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def fail_step(self, scheduler_output: SchedulerOutput,
                  req_ids: Iterable[str]) -> list[Request]:
        """A step failed part-way: what it wrote to the KV cache cannot be trusted.
        Forgets the prefix-cache hashes of the pages it was to fill, then aborts
        `req_ids` (its requests, and whatever else the caller fails with them)."""
        for rid, start, _ in scheduler_output.scheduled():
            req = self.requests.get(rid)
            if req is not None:
                self.kv.uncache_unwritten(req, start, shared_too=True)
        if self.kv.snapshots is not None:
            self.kv.snapshots.discard_pending()
        if self.kv.host is not None:   # its restores and offloads may not have run either
            self.kv.fail_host_copies()
            self._unpark_all()
        done = self.abort_requests(req_ids)
        # update_from_output may have stopped (and released) some before it failed,
        # leaving finished requests in `running`.
        self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return done

    def _release(self, req: Request) -> None:
        self._drop_lora_slot(req)
        self.kv.free(req)
        if self.encoder is not None:
            self.encoder.release(req)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    def _push_waiting(self, req: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            if front:
                self.waiting.appendleft(req)
            else:
                self.waiting.append(req)
        else:
            self.waiting.push(req)

    def _peek_waiting(self) -> Request:
        return self.waiting[0] if self.policy == "fcfs" else self.waiting.peek()

    def _pop_waiting(self) -> Request:
        return self.waiting.popleft() if self.policy == "fcfs" else self.waiting.pop()

    # ---- one step ------------------------------------------------------

    def _pick_victim(self) -> Request:
        if self.policy == "fcfs":
            return self.running[-1]
        return max(self.running, key=lambda r: (r.priority, r.arrival_time))

    def _preempt(self, req: Request) -> None:
        self._drop_lora_slot(req)
        self.kv.free(req)
        if self.encoder is not None:
            self.encoder.release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(req, front=True)

    def schedule(self) -> SchedulerOutput:
        step = _StepDraft(self.max_num_batched_tokens)
        self._schedule_running(step)
        self._schedule_restoring(step)
        if not step.preempted:   # waiting requests, unless this step had to preempt
            self._schedule_waiting(step)
        return self._close_step(step)

    def _schedule_running(self, step: _StepDraft) -> None:
        """Running requests, in order: decodes and unfinished prefill chunks (preempting
        from the back when pages run out). They go out as columns: the runner holds the
        rest of them."""
        kv, running, budget, enc = self.kv, self.running, step.budget, self.encoder
        ids, starts, lens, pages, spec = step.ids, step.starts, step.lens, step.pages, step.spec
        # Hybrid prefix caching: chunks end where a state snapshot is to be kept.
        cuts = kv.snapshots is not None
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            start = req.num_computed_tokens
            # Async scheduling: a token in flight is the next input (taken on device) ...
            known = req.num_tokens + req.num_in_flight
            num_new = min(known - start, budget)
            if num_new <= 0 or (req.num_in_flight and self._ends_in_flight(req)):
                i += 1   # (... unless it is the request's last: nothing is computed past it)
                continue
            if req.spec_token_ids and num_new == req.num_tokens - start == 1:
                # Drafts take only the budget the running rows after this one do not need
                # for a token each. Only a row computing its last token alone drafts: a
                # hybrid's row recomputing after a rollback does not (its backup would be
                # its state before the tokens it recomputes, and a rejection would roll it
                # back further each time).
                num_new += self._num_drafts(req, budget - num_new - (len(running) - i - 1))
            if cuts and (cut := kv.state_cut(req, start)) is not None:
                num_new = min(num_new, cut - start)
            if (images := enc is not None and req.multi_modal is not None) and \
                    (num_new := enc.fit(req, start, num_new)) <= 0:
                i += 1   # its next image is not encoded and does not fit this step
                continue
            ahead = self._lookahead(req, start + num_new) if self.num_lookahead_tokens else 0
            while (new_pages := kv.allocate_slots(req, num_new + ahead)) is None:
                if ahead or start + num_new > known:
                    # Drafts and the drafter's pages ahead go before anyone is preempted.
                    num_new, ahead = min(num_new, known - start), 0
                    continue
                victim = self._pick_victim()
                vi = running.index(victim)
                del running[vi]
                if vi < i:  # priority policy: it was scheduled earlier this step
                    i -= 1
                    if victim.request_id in ids:
                        k = ids.index(victim.request_id)
                        n = victim.num_in_flight   # (its row sampled: it counts itself)
                        if n and starts[k] + lens[k] >= victim.num_tokens + n - 1:
                            victim.num_in_flight -= 1   # it no longer samples this step
                        budget += lens[k]
                        kv.uncache_unwritten(victim, starts[k])
                        del ids[k], starts[k], lens[k], pages[k]
                        spec.pop(victim.request_id, None)
                self._preempt(victim)
                step.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                req.num_computed_tokens = start + num_new
                if images:
                    enc.commit(req, start, num_new)
                if start + num_new >= known:   # it samples: one more token in flight
                    req.num_in_flight += 1
                if (num_drafts := start + num_new - known) > 0:
                    spec[req.request_id] = req.spec_token_ids[:num_drafts]
                    if kv.spec_backups:
                        kv.backup_state(req)
                ids.append(req.request_id)
                starts.append(start)
                lens.append(num_new)
                # allocate_slots' fast path returns fresh empty lists (most decodes).
                pages.append(tuple([b.page_id for b in g] for g in new_pages)
                             if new_pages[0] else new_pages)
                budget -= num_new
                i += 1
        step.budget = budget

    def _schedule_waiting(self, step: _StepDraft) -> None:
        """Waiting requests, in the policy's order, while the budget, the row cap and the
        pages allow: each goes out whole (new to the runner, or resumed: preemption
        dropped its row), after its cached prefix. One whose LoRA adapter finds no slot
        stays waiting, in its place, and the next is tried."""
        running, waiting, budget = self.running, self.waiting, step.budget
        skipped: list[Request] = []
        # (requests taken to restore hold rows too)
        while waiting and budget > 0 and len(running) + len(self.restoring) < self.max_num_seqs:
            req = self._peek_waiting()
            if not self._take_lora_slot(req, step.lora_loads):
                skipped.append(self._pop_waiting())
                continue
            if (fit := self._fit_waiting(req, budget)) is None:
                self._drop_lora_slot(req)   # it keeps waiting: its slot may go
                break
            num_hit, num_new, restore, images = fit
            self._pop_waiting()
            budget -= num_new + restore
            step.restore_tokens += restore
            if num_new:
                self._admit(req, step, num_hit, num_new, images)
            else:   # its hit is restored in this step, computed from the next
                self._park(req, num_hit)
        for req in reversed(skipped):
            self._push_waiting(req, front=True)
        step.budget = budget

    def _admit(self, req: Request, step: _StepDraft, num_hit: int, num_new: int,
               images: bool) -> None:
        """req goes out as a new row: num_new tokens after its hit of num_hit."""
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        req.num_computed_tokens = num_hit + num_new
        if req.num_computed_tokens == req.num_tokens:   # it samples
            req.num_in_flight += 1
        if images:
            self.encoder.commit(req, num_hit, num_new)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        rid, kv = req.request_id, self.kv
        step.new_reqs.append(NewRequestData(
            rid, req.prompt_token_ids, req.output_token_ids[:], req.sampling_params,
            kv.get_group_page_ids(rid), num_hit, num_new, kv.get_state_slot(rid),
            req.lora_slot, req.multi_modal))

    def _fit_waiting(self, req: Request, budget: int) -> tuple[int, int, int, bool] | None:
        """A waiting request's first chunk within `budget`, pages allocated -> (cached, new
        tokens, its host-tier restore's budget, has images); None: something does not fit.
        No new tokens: its hit is restored first, its pages alone taken (core/restoring.py)."""
        kv = self.kv
        hit, num_hit = kv.get_computed_pages(req)
        restore = kv.restore_budget(req, self.max_num_batched_tokens - 1)
        if restore >= budget:
            return None
        if kv.hit_waits(req, hit):
            if kv.allocate_slots(req, 0, hit, num_hit) is None:
                return None
            return num_hit, 0, restore, False
        fit = self._fit_chunk(req, num_hit, budget - restore, hit, num_hit)
        return None if fit is None else (num_hit, fit[0], restore, fit[1])

    def _fit_chunk(self, req: Request, start: int, budget: int,
                   hit: GroupPages | None = None, num_hit: int = 0) -> tuple[int, bool] | None:
        """A new row's first chunk from `start` within `budget`, its pages allocated (with
        the hit's: num_hit tokens past the request's computed ones) -> (new tokens, has
        images); None: something does not fit."""
        kv, enc = self.kv, self.encoder
        num_new = min(req.num_tokens - start, budget)
        if kv.snapshots is not None and (cut := kv.state_cut(req, start)) is not None:
            num_new = min(num_new, cut - start)
        if (images := enc is not None and req.multi_modal is not None) and \
                (num_new := enc.fit(req, start, num_new)) <= 0:
            return None   # its first image waits for encoder budget or rows
        ahead = self._lookahead(req, start + num_new)
        if kv.allocate_slots(req, num_new + ahead, hit, num_hit) is None and (
                not ahead or kv.allocate_slots(req, num_new, hit, num_hit) is None):
            return None   # (the drafter's pages ahead are dropped first)
        return num_new, images

    def _close_step(self, step: _StepDraft) -> SchedulerOutput:
        """The step's SchedulerOutput: its rows, the requests finished since the last
        step, and a hybrid's state copies (snapshots to keep, backups)."""
        kv = self.kv
        finished = self._finished_ids
        self._finished_ids = []
        restores, saves = [], []
        if kv.snapshots is not None:
            # Snapshots are only taken where a chunk ends on a page boundary: most decode
            # rows do not, and are not looked at further (nor rows with drafts, whose
            # state at the end is known good only once they are all accepted).
            requests, ps = self.requests, self.page_size
            ends = [(requests[r], s + n) for r, s, n in zip(step.ids, step.starts, step.lens)
                    if (s + n) % ps == 0 and r not in step.spec]
            ends += [(requests[r.req_id], e) for r in step.new_reqs
                     if (e := r.num_computed_tokens + r.num_new_tokens) % ps == 0]
            kv.plan_state_saves(ends)
        if kv.snapshots is not None or kv.spec_backups:
            restores, saves = kv.take_state_copies()
        jobs, frees = self.encoder.take() if self.encoder is not None else ([], [])
        return SchedulerOutput(
            encoder_jobs=jobs, encoder_frees=frees,
            state_restores=restores, state_saves=saves, spec_token_ids=step.spec,
            host_copies=None if kv.host is None else kv.take_host_copies(),
            restoring_req_ids=list(self.restoring),
            lora_loads=step.lora_loads, new_reqs=step.new_reqs,
            cached_reqs=CachedRequestData(step.ids, step.starts, step.lens, step.pages),
            num_scheduled_tokens=(self.max_num_batched_tokens - step.budget
                                  - step.restore_tokens),
            preempted_req_ids=step.preempted,
            finished_req_ids=finished,
        )

    # ---- queries -------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.restoring)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.kv.prefix_cache_stats.hit_rate

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        pc = self.kv.prefix_cache_stats
        return SchedulerStats(
            num_running=self.num_running, num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage, prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits, num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=sum(self.spec_accepted_per_pos),
            spec_accepted_per_pos=tuple(self.spec_accepted_per_pos),
            host=None if self.kv.host is None else self.kv.host.stats(),
            max_lora=self.lora.max_loras if self.lora else 0,
            running_lora_adapters=_adapter_names(self.running) if self.lora else (),
            waiting_lora_adapters=_adapter_names(self.waiting) if self.lora else (),
        )


def _adapter_names(requests) -> tuple[str, ...]:
    """The LoRA adapters some of `requests` use, by name (sorted)."""
    return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request}))
