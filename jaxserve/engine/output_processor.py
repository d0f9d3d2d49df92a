"""Turns scheduler updates into vLLM-shaped RequestOutputs.

Owns, per completion, the incremental detokenizer (stop strings), the sampled
logprobs and the prompt logprobs; groups the n completions of a request.

Two output kinds: final-only (offline `LLM.generate`: one RequestOutput per
request, when all its completions are done) and delta streaming (the server:
after every step, each changed request's new text, token ids and logprobs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.core.request import Request, RequestStatus
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.logprobs import make_logprob_dict


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
    num_cached_tokens: int = 0
    num_unfinished: int = 0
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer, *, stream: bool = False):
        self.tokenizer = tokenizer
        self.stream = stream   # delta outputs after every step, else final outputs only
        self._groups: dict[str, _Group] = {}
        self._child: dict[str, tuple[_Group, _Completion]] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params,
            child_ids: list[str]) -> None:
        comps = []
        for i in range(len(child_ids)):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens, incremental=self.stream)
            want_lp = params.logprobs is not None
            comps.append(_Completion(i, detok, [] if want_lp else None, 0.0 if want_lp else None))
        prompt_lps = [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None
        group = _Group(request_id, prompt, prompt_token_ids, params, comps, list(child_ids),
                       prompt_lps, num_unfinished=len(comps))
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

    def process(self, updated: list[Request], runner_out) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs of changed groups and child ids stopped by a stop string."""
        changed: dict[str, _Group] = {}
        stopped: list[str] = []
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
                self._add_tokens(group, comp, req.request_id, new_ids, runner_out)
                if comp.detok is not None and comp.detok.stop_reason is not None:
                    comp.finish_reason, comp.stop_reason = "stop", comp.detok.stop_reason
                    stopped.append(req.request_id)
            if comp.finish_reason is None and req.is_finished():
                comp.finish_reason = req.get_finish_reason()
                comp.stop_reason = req.stop_reason
            if comp.finish_reason is not None:
                self._finish(group, comp, req.request_id)
            if group.num_cached_tokens == 0 and req.num_cached_tokens > 0:
                group.num_cached_tokens = req.num_cached_tokens
            changed[group.request_id] = group
        outs = [self._output(g) for g in changed.values()
                if self.stream or g.num_unfinished == 0]
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
        return self._output(group)

    # ---- internals ------------------------------------------------------------------
    def _add_tokens(self, group: _Group, comp: _Completion, child_id: str, new_ids: list[int],
                    runner_out) -> None:
        if comp.finish_reason is not None:
            return   # tokens after a stop string (same step) are dropped
        comp.token_ids.extend(new_ids)
        if comp.detok is not None:
            comp.detok.update(new_ids)
        k = group.params.logprobs
        if k is not None and child_id in runner_out.logprobs:
            ids, lps, rank = runner_out.logprobs[child_id]
            comp.logprobs.append(make_logprob_dict(
                int(ids[0]), float(lps[0]), rank, ids[1:], lps[1:], k, self._decoder(comp)))
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

    def _finish(self, group: _Group, comp: _Completion, child_id: str) -> None:
        if self._child.pop(child_id, None) is None:
            return
        if comp.detok is not None:
            comp.detok.finalize()
        group.num_unfinished -= 1

    def _output(self, group: _Group) -> RequestOutput:
        outs = [self._delta(c) if self.stream else self._full(c) for c in group.completions]
        prompt_lps = None
        if group.prompt_logprobs is not None and not (self.stream and group.prompt_logprobs_sent):
            # Streams carry prompt logprobs once, when all of them are known.
            if not self.stream or all(e is not None for e in group.prompt_logprobs[1:]):
                prompt_lps = group.prompt_logprobs
                group.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids, prompt_logprobs=prompt_lps,
            outputs=[o for o in outs if o is not None], finished=group.num_unfinished == 0,
            num_cached_tokens=group.num_cached_tokens)

    @staticmethod
    def _full(c: _Completion) -> CompletionOutput:
        return CompletionOutput(
            index=c.index, text=c.detok.output_text if c.detok is not None else "",
            token_ids=list(c.token_ids), cumulative_logprob=c.cumulative_logprob,
            logprobs=c.logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason)

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
