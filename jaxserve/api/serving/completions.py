"""/v1/completions: one engine request per prompt ("{rid}-{i}"), n choices each;
echo puts the prompt before its choices' text (and, with logprobs, its tokens'
logprobs before theirs)."""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jaxserve.api.errors import APIError, bad_request
from jaxserve.api.protocol import CompletionRequest, sampling_params
from jaxserve.api.serving.base import OpenAIServing
from jaxserve.api.serving.choices import Choice, accumulate, usage
from jaxserve.api.serving.logprobs import completion_logprobs, end_offset
from jaxserve.api.serving.streaming import data, sse
from jaxserve.core.outputs import RequestOutput
from jaxserve.engine.input_processor import EngineRequest
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams


class CompletionsServing:
    def __init__(self, base: OpenAIServing):
        self.base = base

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        base = self.base
        base.check_open()
        lora = base.check_model(req.model)
        if req.max_tokens == 0 and not req.echo:
            # (vLLM refuses it too) an answer of nothing is surely not what was meant
            raise APIError(400, "max_tokens=0 generates nothing: it is for scoring the prompt, "
                                "with echo=true (and logprobs for its token logprobs)",
                           "max_tokens")
        try:
            params = sampling_params(req, base.settings.generation_defaults,
                                     max_tokens=req.max_tokens, logprobs=req.logprobs,
                                     prompt_logprobs=req.logprobs if req.echo else None)
        except ValueError as e:
            raise bad_request(e)
        rid = f"cmpl-{uuid.uuid4().hex}"
        # before any prompt is processed: a million prompts are not tokenized to be refused
        base.check_size(len(prompt_list(req.prompt)), params.n)
        params = await base.with_grammar(req, raw, params)
        prompts = await base.in_worker(req, self._prompts, rid, req, params, lora)
        answer = base.admit(len(prompts), params.n)
        stream = base.generate(rid, prompts, params, answer)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return sse(self._chunks(rid, prompts, params, req, stream, include_usage), answer)
        prompt_lps: dict[int, list] = {}
        try:
            choices = await base.collect(stream, raw, params.n, prompt_lps)
        finally:
            answer.close()
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": int(time.time()),
            "model": base.model_name(req.model),
            "choices": [self._choice(c, c.index // params.n, prompts, prompt_lps, req)
                        for c in choices],
            "usage": usage(prompts, choices)})

    def _prompts(self, rid: str, req: CompletionRequest, params: SamplingParams,
                 lora: LoRARequest | None) -> list[EngineRequest]:
        """Worker thread: the request's prompts, one engine request each ("{rid}-{i}")."""
        return [self.base.inputs.process(f"{rid}-{i}", p, params, priority=req.priority,
                                         cache_salt=req.cache_salt, lora_request=lora,
                                         add_special_tokens=req.add_special_tokens)
                for i, p in enumerate(prompt_list(req.prompt))]

    def _choice(self, c: Choice, i: int, prompts: list[EngineRequest],
                prompt_lps: dict[int, list], req: CompletionRequest) -> dict:
        text, logprobs = c.text, None
        if req.echo:
            text = self._prompt_text(prompts[i]) + text
        if req.logprobs is not None:
            logprobs = completion_logprobs(
                c.logprobs, req.logprobs, self.base.tokenizer,
                prompts[i].prompt_token_ids if req.echo else None,
                prompt_lps.get(i))
        return {"index": c.index, "text": text, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def _prompt_text(self, prompt: EngineRequest) -> str:
        if prompt.prompt is not None:
            return prompt.prompt
        tokenizer = self.base.tokenizer
        if tokenizer is None:
            return ""
        return tokenizer.decode(list(prompt.prompt_token_ids))

    async def _chunks(self, rid: str, prompts: list[EngineRequest], params: SamplingParams,
                      req: CompletionRequest,
                      stream: AsyncIterator[tuple[int, RequestOutput]],
                      include_usage: bool) -> AsyncIterator[str]:
        created, model, n = int(time.time()), self.base.model_name(req.model), params.n
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        choices: dict[int, Choice] = {}
        echoed: set[int] = set()
        prompt_lps: dict[int, list] = {}   # per prompt, once the engine sent them
        offsets: dict[int, int] = {}       # per choice: the text_offset of its next token
        async for i, out in stream:
            if out.prompt_logprobs is not None:   # (with or before the first tokens)
                prompt_lps[i] = out.prompt_logprobs
            for c in out.outputs:
                idx = i * n + c.index
                accumulate(choices.setdefault(idx, Choice(idx)), c)
                text = c.text
                echo = req.echo and idx not in echoed
                if echo:
                    echoed.add(idx)
                    text = self._prompt_text(prompts[i]) + text
                logprobs = None
                if req.logprobs is not None and (c.logprobs or echo):
                    # text_offset runs on from the choice's earlier chunks, as in the
                    # whole answer.
                    start = offsets.get(idx, 0)
                    logprobs = completion_logprobs(
                        c.logprobs or [], req.logprobs, self.base.tokenizer,
                        prompts[i].prompt_token_ids if echo else None, prompt_lps.get(i),
                        offset=start)
                    offsets[idx] = end_offset(logprobs, start)
                yield data({**head, "choices": [{
                    "index": idx, "text": text, "logprobs": logprobs,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
        if include_usage:
            yield data({**head, "choices": [], "usage": usage(prompts, list(choices.values()))})


def prompt_list(prompt: str | list) -> list:
    """The prompts a completions request's `prompt` holds. A bare [] is one empty prompt,
    which the input processor refuses."""
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        return [prompt]
    return prompt
