"""/v1/chat/completions: the conversation through the chat template as one engine request
("{rid}-0"), n choices; each choice's text read by a ChoiceReader (api/chat_output.py:
reasoning, tool calls) into a message, or into deltas when streamed."""
from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jaxserve.api.chat_output import REASONING_END, ChoiceReader, prompt_ends_in_reasoning
from jaxserve.api.chat_prompt import echoed_text, render_chat_prompt, response_role
from jaxserve.api.errors import APIError, bad_request
from jaxserve.api.protocol import ChatCompletionRequest, sampling_params
from jaxserve.api.reasoning_parsers import get_reasoning_parser
from jaxserve.api.serving.base import OpenAIServing
from jaxserve.api.serving.choices import Choice, accumulate, usage
from jaxserve.api.serving.logprobs import chat_logprobs
from jaxserve.api.serving.streaming import data, sse
from jaxserve.api.tools import ToolSetup, tool_setup
from jaxserve.core.outputs import RequestOutput
from jaxserve.errors import InputError
from jaxserve.engine.input_processor import EngineRequest
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams

# A factory of ChoiceReaders, one per choice of an answer.
ReaderFactory = Callable[[], ChoiceReader]


class ChatServing:
    def __init__(self, base: OpenAIServing):
        self.base = base

    async def create_chat_completion(self, req: ChatCompletionRequest,
                                     raw: Request) -> Response:
        base = self.base
        base.check_open()
        lora = base.check_model(req.model)
        top = req.top_logprobs
        if top is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        params, tools = self._params(req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        params = await base.with_grammar(req, raw, params)
        prompts, in_reasoning = await base.in_worker(req, self._prompts, rid, req,
                                                     params, tools, lora)
        reader = self._reader(tools, in_reasoning, response_role(req))
        answer = base.admit(1, params.n)
        stream = base.generate(rid, prompts, params, answer)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return sse(self._chunks(rid, prompts, req, stream, include_usage, reader), answer)
        try:
            choices = await base.collect(stream, raw, params.n)
        finally:
            answer.close()
        readers = [reader() for _ in choices]
        echo = echoed_text(req) if req.echo else ""
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": base.model_name(req.model),
            "choices": [{"index": c.index, "message": _echoed(r.message(c.text), echo),
                         "logprobs": chat_logprobs(c.logprobs, top or 0)
                         if req.logprobs else None,
                         "finish_reason": r.finish_reason(c.finish_reason),
                         "stop_reason": c.stop_reason}
                        for c, r in zip(choices, readers)],
            "usage": usage(prompts, choices)})

    def _params(self, req: ChatCompletionRequest) -> tuple[SamplingParams, ToolSetup]:
        """The request's sampling parameters (a forced tool call's grammar included) and
        its checked tools; a 400 naming the field at fault."""
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        settings = self.base.settings
        try:
            params = sampling_params(req, settings.generation_defaults,
                                     max_tokens=max_tokens,
                                     logprobs=(req.top_logprobs or 0) if req.logprobs else None)
            tools = tool_setup(req.tools, req.tool_choice,
                               auto_parser=settings.auto_tool_parser,
                               parallel=req.parallel_tool_calls)
            return _with_tool_constraint(params, tools), tools
        except ValueError as e:
            raise bad_request(e)

    def _prompts(self, rid: str, req: ChatCompletionRequest, params: SamplingParams,
                 tools: ToolSetup, lora: LoRARequest | None = None
                 ) -> tuple[list[EngineRequest], bool]:
        """Worker thread: the conversation rendered by the chat template, as one engine
        request ("{rid}-0"), and whether the template opened a think block. Then (with
        --reasoning-parser) a structured output applies after the model closes it."""
        base = self.base
        ids, multi_modal = render_chat_prompt(
            base.inputs, req, chat_template=base.settings.chat_template, tools=tools.tools,
            add_special_tokens=req.add_special_tokens, template_kwargs=base.template_kwargs(req))
        in_reasoning = bool(base.settings.reasoning_parser) and prompt_ends_in_reasoning(
            base.inputs.tokenizer.decode(ids[-16:]))
        if in_reasoning and params.structured_outputs is not None:
            end = base.inputs.tokenize(REASONING_END, add_special_tokens=False)
            params = replace(params, grammar_after_ids=tuple(end))
        return [base.inputs.process(f"{rid}-0", ids, params, priority=req.priority,
                                    cache_salt=req.cache_salt, multi_modal=multi_modal,
                                    lora_request=lora)], in_reasoning

    def _reader(self, tools: ToolSetup, in_reasoning: bool, role: str) -> ReaderFactory:
        """A factory of ChoiceReaders (one per choice) for this request's answer."""
        name = self.base.settings.reasoning_parser
        parser = get_reasoning_parser(name) if name else None
        return lambda: ChoiceReader(tools, parser, in_reasoning, role)

    async def _chunks(self, rid: str, prompts: list[EngineRequest], req: ChatCompletionRequest,
                      stream: AsyncIterator[tuple[int, RequestOutput]], include_usage: bool,
                      reader: ReaderFactory) -> AsyncIterator[str]:
        created, model = int(time.time()), self.base.model_name(req.model)
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        choices: dict[int, Choice] = {}
        readers: dict[int, ChoiceReader] = {}
        echo = echoed_text(req) if req.echo else ""
        async for _, out in stream:
            for c in out.outputs:
                first = c.index not in choices
                acc = choices.setdefault(c.index, Choice(c.index))
                r = readers.setdefault(c.index, reader())
                accumulate(acc, c)
                if first:
                    yield data({**head, "choices": [{
                        "index": c.index, "delta": {"role": r.role, "content": ""},
                        "logprobs": None, "finish_reason": None}]})
                    if echo:   # (vLLM's order: the role, the echo, then the answer)
                        yield data({**head, "choices": [{
                            "index": c.index, "delta": {"content": echo},
                            "logprobs": None, "finish_reason": None}]})
                logprobs = (chat_logprobs(c.logprobs, req.top_logprobs or 0)
                            if req.logprobs and c.logprobs else None)
                delta_msg = r.delta(c.text, final=c.finish_reason is not None)
                if not delta_msg and not logprobs and c.finish_reason is None:
                    continue        # held back by a parser: nothing to send yet
                yield data({**head, "choices": [{
                    "index": c.index, "delta": delta_msg, "logprobs": logprobs,
                    "finish_reason": r.finish_reason(c.finish_reason),
                    "stop_reason": c.stop_reason}]})
        if include_usage:
            yield data({**head, "choices": [], "usage": usage(prompts, list(choices.values()))})


def _with_tool_constraint(params: SamplingParams, tools: ToolSetup) -> SamplingParams:
    """params with the grammar that forces a "required" or named tool call."""
    forced = tools.constraint()
    if forced is None:
        return params
    if params.structured_outputs is not None:
        raise InputError("tool_choice forces a tool call; it cannot be combined with "
                         "response_format or structured outputs", "tool_choice")
    try:
        return replace(params, structured_outputs=forced)
    except InputError as e:
        raise InputError(str(e), "tool_choice") from None


def _echoed(message: dict, echo: str) -> dict:
    """The whole message with `echo` before its content (as vLLM: after the parsers)."""
    if echo:
        message["content"] = echo + (message.get("content") or "")
    return message
