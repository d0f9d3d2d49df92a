"""Turns scheduler updates into vLLM-shaped RequestOutputs.

Owns, per completion, the incremental detokenizer (stop strings), the sampled
logprobs and the prompt logprobs; groups the n completions of a request.

Each request has an output kind (SamplingParams.output_kind, vLLM's): final-only
(one RequestOutput when all its completions are done; offline `LLM.generate` and a
non-streaming engine always), cumulative (after every step that changed it, all of
it so far) or delta (after every such step, only the new text, token ids and
logprobs: what the server streams). best_of > n makes it final-only: the n returned
are known only once every sample is done.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from jaxserve.core import request_metrics
from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.request_metrics import RequestMetrics
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.logprobs import make_logprob_dict
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:   # for hints only: the runner brings jax, transformers is heavy
    from transformers import PreTrainedTokenizerBase

    from jaxserve.runner.model_runner import ModelRunnerOutput


@dataclass
class _Completion:
    index: int
    detok: IncrementalDetokenizer | None
    logprobs: list | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] = field(default_factory=list)
    num_sent: int = 0            # delta mode: tokens already streamed
    done_sent: bool = False      # delta mode: the finish was already streamed


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: object
    completions: list[_Completion]
    child_ids: list[str]
    prompt_logprobs: list | None
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    num_unfinished: int = 0
    prompt_logprobs_sent: bool = False
    kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, *, stream: bool = False):
        self.tokenizer = tokenizer
        self.stream = stream   # delta outputs after every step, else final outputs only
        self._groups: dict[str, _Group] = {}
        self._child: dict[str, tuple[_Group, _Completion]] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams,
            child_ids: list[str], arrival_time: float | None = None) -> None:
        """arrival_time: when the request arrived, a time.monotonic() reading (None: now)."""
        kind = RequestOutputKind.FINAL_ONLY
        if self.stream and not params.ranks_samples:
            kind = params.output_kind
        comps = []
        for i in range(len(child_ids)):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens,
                    incremental=kind != RequestOutputKind.FINAL_ONLY)
            want_lp = params.logprobs is not None
            # Ranking best_of samples needs each one's cumulative logprob.
            comps.append(_Completion(i, detok, [] if want_lp else None,
                                     0.0 if want_lp or params.ranks_samples else None))
        prompt_lps = [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None
        arrival = (request_metrics.now() if arrival_time is None
                   else request_metrics.from_monotonic(arrival_time))
        group = _Group(request_id, prompt, prompt_token_ids, params, comps, list(child_ids),
                       prompt_lps, RequestMetrics(arrival), num_unfinished=len(comps), kind=kind)
        self._groups[request_id] = group
        for cid, comp in zip(child_ids, comps):
            self._child[cid] = (group, comp)

    def child_ids(self, request_id: str) -> list[str]:
        group = self._groups.get(request_id)
        return list(group.child_ids) if group is not None else []

    def parents_of(self, child_ids: list[str]) -> list[str]:
        """The request ids whose completions include any of `child_ids` (a scan of the
        live requests: only a failed step asks)."""
        wanted = set(child_ids)
        return [rid for rid, g in self._groups.items() if wanted.intersection(g.child_ids)]

    def has(self, request_id: str) -> bool:
        return request_id in self._groups

    def mark_scheduled(self, child_ids: list[str]) -> None:
        """A step is about to compute these completions (new, or resumed after a
        preemption): the first time for a request is its first_scheduled_time."""
        t = request_metrics.now()
        for cid in child_ids:
            entry = self._child.get(cid)
            if entry is not None and entry[0].metrics.first_scheduled_time is None:
                entry[0].metrics.first_scheduled_time = t

    def process(self, updated: list[Request], runner_out: ModelRunnerOutput
                ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs of changed groups and child ids stopped by a stop string."""
        changed: dict[str, _Group] = {}
        stopped: list[str] = []
        t = request_metrics.now()   # one time for the whole step: its tokens came together
        for req_id, plp in runner_out.prompt_logprobs.items():
            entry = self._child.get(req_id)
            if entry is not None:
                self._add_prompt_logprobs(entry[0], plp)
                changed[entry[0].request_id] = entry[0]
        for req in updated:
            entry = self._child.get(req.request_id)
            if entry is None:
                continue
            group, comp = entry
            new_ids = req.output_token_ids[len(comp.token_ids):]
            if new_ids:
                self._add_tokens(group, comp, req.request_id, new_ids, runner_out, t)
                if comp.detok is not None and comp.detok.stop_reason is not None:
                    comp.finish_reason, comp.stop_reason = "stop", comp.detok.stop_reason
                    stopped.append(req.request_id)
            if req.status == RequestStatus.FINISHED_ERROR:   # over a stop string, too
                comp.finish_reason, comp.stop_reason = "error", None
            elif comp.finish_reason is None and req.is_finished():
                comp.finish_reason = req.get_finish_reason()
                comp.stop_reason = req.stop_reason
            if comp.finish_reason is not None:
                self._finish(group, comp, req.request_id, t)
            if group.num_cached_tokens == 0 and req.num_cached_tokens > 0:
                group.num_cached_tokens = req.num_cached_tokens
            changed[group.request_id] = group
        outs = [self._output(g) for g in changed.values()
                if g.kind != RequestOutputKind.FINAL_ONLY or g.num_unfinished == 0]
        for g in changed.values():
            if g.num_unfinished == 0:
                self._groups.pop(g.request_id, None)
        return outs, stopped

    def abort(self, request_id: str) -> RequestOutput | None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for cid, comp in zip(group.child_ids, group.completions):
            if self._child.pop(cid, None) is not None and comp.finish_reason is None:
                comp.finish_reason = RequestStatus.finish_reason(RequestStatus.FINISHED_ABORTED)
        group.num_unfinished = 0
        group.metrics.finished_time = request_metrics.now()
        return self._output(group)

    # ---- internals ------------------------------------------------------------------
    def _add_tokens(self, group: _Group, comp: _Completion, child_id: str, new_ids: list[int],
                    runner_out, t: float) -> None:
        if comp.finish_reason is not None:
            return   # tokens after a stop string (same step) are dropped
        detok = comp.detok
        if detok is not None and detok.stop and len(new_ids) > 1:
            # Several tokens at once (accepted drafts): those after a stop string are
            # dropped, as they would never have been sampled one at a time.
            for i, tok in enumerate(new_ids):
                if detok.update([tok]) is not None:
                    new_ids = new_ids[:i + 1]
                    break
        elif detok is not None:
            detok.update(new_ids)
        comp.token_ids.extend(new_ids)
        m = group.metrics
        if m.first_token_time is None:
            m.first_token_time = t
        m.last_token_time = t
        m.num_generation_tokens += len(new_ids)
        k = group.params.logprobs
        if comp.cumulative_logprob is not None and child_id in runner_out.logprobs:
            # One entry per token the step gave (several when drafts were accepted).
            for ids, lps, rank in runner_out.logprobs[child_id][:len(new_ids)]:
                if k is not None:
                    comp.logprobs.append(make_logprob_dict(
                        int(ids[0]), float(lps[0]), rank, ids[1:], lps[1:], k,
                        self._decoder(comp)))
                comp.cumulative_logprob += float(lps[0])

    def _decoder(self, comp: _Completion):
        return comp.detok.decode_token if comp.detok is not None else None

    def _add_prompt_logprobs(self, group: _Group, plp) -> None:
        if group.prompt_logprobs is None:
            return
        first, lp, rank, top_ids, top_lp = plp
        k = group.params.prompt_logprobs
        decode = None if self.tokenizer is None else (lambda t: self.tokenizer.decode([t]))
        for j in range(len(lp)):
            pos = first + 1 + j   # logits at `first + j` predict prompt token `first + j + 1`
            group.prompt_logprobs[pos] = make_logprob_dict(
                group.prompt_token_ids[pos], float(lp[j]), int(rank[j]), top_ids[j], top_lp[j],
                k, decode)

    def _finish(self, group: _Group, comp: _Completion, child_id: str, t: float) -> None:
        if self._child.pop(child_id, None) is None:
            return
        if comp.detok is not None:
            comp.detok.finalize()
        group.num_unfinished -= 1
        if group.num_unfinished == 0:
            group.metrics.finished_time = t

    def _output(self, group: _Group) -> RequestOutput:
        delta = group.kind == RequestOutputKind.DELTA
        comps = group.completions
        if group.params.ranks_samples:
            comps = _best(comps, group.params.n)
        outs = [self._delta(c) if delta else self._full(c) for c in comps]
        prompt_lps = None
        if group.prompt_logprobs is not None and not (delta and group.prompt_logprobs_sent):
            # Streams carry prompt logprobs once all of them are known (deltas: only once).
            if group.kind == RequestOutputKind.FINAL_ONLY or \
                    all(e is not None for e in group.prompt_logprobs[1:]):
                prompt_lps = group.prompt_logprobs
                group.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids, prompt_logprobs=prompt_lps,
            outputs=[o for o in outs if o is not None], finished=group.num_unfinished == 0,
            num_cached_tokens=group.num_cached_tokens, metrics=replace(group.metrics))

    @staticmethod
    def _full(c: _Completion) -> CompletionOutput:
        """All of the completion so far (less text that may still start a stop string)."""
        text = "" if c.detok is None else \
            c.detok.get_next_output_text(c.finish_reason is not None, delta=False)
        return CompletionOutput(
            index=c.index, text=text,
            token_ids=list(c.token_ids), cumulative_logprob=c.cumulative_logprob,
            # a copy: a cumulative stream's earlier outputs must not grow with later ones
            logprobs=None if c.logprobs is None else list(c.logprobs),
            finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    @staticmethod
    def _delta(c: _Completion) -> CompletionOutput | None:
        """What this completion added since it was last streamed (None: nothing new)."""
        finished = c.finish_reason is not None
        new_ids = c.token_ids[c.num_sent:]
        text = c.detok.get_next_output_text(finished, delta=True) if c.detok is not None else ""
        if not new_ids and not text and (not finished or c.done_sent):
            return None
        lps = c.logprobs[c.num_sent:] if c.logprobs is not None else None
        c.num_sent = len(c.token_ids)
        c.done_sent = finished
        return CompletionOutput(
            index=c.index, text=text, token_ids=new_ids, cumulative_logprob=c.cumulative_logprob,
            logprobs=lps, finish_reason=c.finish_reason, stop_reason=c.stop_reason)


def _best(completions: list[_Completion], n: int) -> list[_Completion]:
    """The n completions of highest cumulative logprob, best first and indexed 0..n-1
    in that order (vLLM V0's best_of; the sum favours shorter completions, as there)."""
    ranked = sorted(completions, key=lambda c: c.cumulative_logprob, reverse=True)[:n]
    return [replace(c, index=i) for i, c in enumerate(ranked)]
