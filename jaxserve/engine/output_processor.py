"""Turns scheduler updates into vLLM-shaped RequestOutputs.

Owns, per completion, the incremental detokenizer (stop strings), the sampled
logprobs and the prompt logprobs; groups the n completions of a request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.core.detokenizer import IncrementalDetokenizer
from jaxserve.core.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.core.request import Request, RequestStatus


@dataclass
class _Completion:
    index: int
    detok: IncrementalDetokenizer | None
    logprobs: list | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] = field(default_factory=list)


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: object
    completions: list[_Completion]
    prompt_logprobs: list | None
    num_cached_tokens: int = 0
    num_unfinished: int = 0


class OutputProcessor:
    def __init__(self, tokenizer, *, stream: bool = False):
        self.tokenizer = tokenizer
        self.stream = stream   # streaming callers want text after every step
        self._groups: dict[str, _Group] = {}
        self._child: dict[str, tuple[_Group, _Completion]] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params,
            child_ids: list[str]) -> None:
        comps = []
        for i, cid in enumerate(child_ids):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens, incremental=self.stream)
            comps.append(_Completion(i, detok, [] if params.logprobs is not None else None,
                                     0.0 if params.logprobs is not None else None))
        prompt_lps = None
        if params.prompt_logprobs is not None:
            prompt_lps = [None] * len(prompt_token_ids)
        group = _Group(request_id, prompt, prompt_token_ids, params, comps, prompt_lps,
                       num_unfinished=len(comps))
        self._groups[request_id] = group
        for cid, comp in zip(child_ids, comps):
            self._child[cid] = (group, comp)

    def child_ids(self, request_id: str) -> list[str]:
        return [cid for cid, (g, _) in self._child.items() if g.request_id == request_id]

    def has(self, request_id: str) -> bool:
        return request_id in self._groups

    def process(self, updated: list[Request], runner_out) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs of changed groups and child ids stopped by a stop string."""
        changed: dict[str, _Group] = {}
        stopped: list[str] = []
        for req in updated:
            entry = self._child.get(req.request_id)
            if entry is None:
                continue
            group, comp = entry
            new_ids = req.output_token_ids[len(comp.token_ids):]
            if new_ids and comp.finish_reason is None:
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
        for req_id, plp in runner_out.prompt_logprobs.items():
            entry = self._child.get(req_id)
            if entry is not None:
                self._add_prompt_logprobs(entry[0], plp)
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
        for cid in [c for c, (g, _) in self._child.items() if g is group]:
            _, comp = self._child.pop(cid)
            if comp.finish_reason is None:
                comp.finish_reason = RequestStatus.finish_reason(RequestStatus.FINISHED_ABORTED)
        group.num_unfinished = 0
        return self._output(group)

    # ---- internals ------------------------------------------------------------------
    def _add_tokens(self, group: _Group, comp: _Completion, child_id: str, new_ids: list[int],
                    runner_out) -> None:
        comp.token_ids.extend(new_ids)
        if comp.detok is not None:
            comp.detok.update(new_ids)
        k = group.params.logprobs
        if k is not None and child_id in runner_out.logprobs:
            ids, lps, rank = runner_out.logprobs[child_id]
            entry = {int(ids[0]): Logprob(float(lps[0]), rank, self._decode(comp, int(ids[0])))}
            for j in range(1, k + 1):
                tid = int(ids[j])
                if tid not in entry:
                    entry[tid] = Logprob(float(lps[j]), j, self._decode(comp, tid))
            comp.logprobs.append(entry)
            comp.cumulative_logprob += float(lps[0])

    def _decode(self, comp: _Completion, token_id: int) -> str | None:
        return comp.detok.decode_token(token_id) if comp.detok is not None else None

    def _add_prompt_logprobs(self, group: _Group, plp) -> None:
        if group.prompt_logprobs is None:
            return
        first, lp, rank, top_ids, top_lp = plp
        k = group.params.prompt_logprobs
        for j in range(len(lp)):
            pos = first + 1 + j   # logits at `first + j` predict prompt token `first + j + 1`
            tid = group.prompt_token_ids[pos]
            entry = {tid: Logprob(float(lp[j]), int(rank[j]), self._decode_plain(tid))}
            for m in range(k):
                t = int(top_ids[j, m])
                if t not in entry:
                    entry[t] = Logprob(float(top_lp[j, m]), m + 1, self._decode_plain(t))
            group.prompt_logprobs[pos] = entry

    def _decode_plain(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _finish(self, group: _Group, comp: _Completion, child_id: str) -> None:
        if self._child.pop(child_id, None) is None:
            return
        if comp.detok is not None:
            comp.detok.finalize()
        group.num_unfinished -= 1

    def _output(self, group: _Group) -> RequestOutput:
        outs = [CompletionOutput(
            index=c.index,
            text=c.detok.output_text if c.detok is not None else "",
            token_ids=list(c.token_ids),
            cumulative_logprob=c.cumulative_logprob,
            logprobs=c.logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            for c in group.completions]
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids, prompt_logprobs=group.prompt_logprobs,
            outputs=outs, finished=group.num_unfinished == 0,
            num_cached_tokens=group.num_cached_tokens)
