"""The OpenAI completions and chat endpoints on top of AsyncEngine.

Every prompt of a request becomes one engine request (its n completions are
children inside the engine); their delta outputs are merged into one stream
of choices, indexed prompt_index * n + completion_index as OpenAI does.

Every prompt goes through the input processor (tokenizing, chat-template rendering,
every limit) once, in a worker thread, never on the event loop (a big prompt must
not freeze /health and every other stream) and never in the engine thread. Each
admitted request holds its n * prompts sequences against --max-waiting-requests
until the engine finishes it or its response ends, however it ends (see _Answer).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxserve.api.errors import APIError, bad_request, error_body
from jaxserve.api.internal_errors import log_unexpected
from jaxserve.api.log_values import DEFAULT_MAX_LOG_LEN, loggable
from jaxserve.api.chat_output import REASONING_END, ChoiceReader, prompt_ends_in_reasoning
from jaxserve.api.chat_prompt import echoed_text, render_chat_prompt, response_role
from jaxserve.api.metrics import Metrics
from jaxserve.api.protocol import (ChatCompletionRequest, CompletionRequest, TokenizeRequest,
                                   constraint_field, sampling_params)
from jaxserve.api.reasoning_parsers import get_reasoning_parser
from jaxserve.api.tools import ToolSetup, tool_setup
from jaxserve.core.outputs import RequestOutput
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError
from jaxserve.engine.errors import InputError
from jaxserve.engine.input_processor import EngineRequest
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve")

_DISCONNECT_POLL_S = 0.2


@dataclass(frozen=True)
class ServerSettings:
    # --served-model-name: requests may name any; answers and metrics carry the first.
    served_model_names: tuple[str, ...]
    max_model_len: int
    api_key: tuple[str, ...] | str | None = None   # --api-key: any of them is let in
    max_waiting_requests: int = 1024
    disable_log_requests: bool = False
    chat_template: str | None = None
    generation_defaults: dict = field(default_factory=dict)
    max_request_body_bytes: int = 32 * 2**20
    auto_tool_parser: str | None = None     # --tool-call-parser, with --enable-auto-tool-choice
    reasoning_parser: str | None = None     # --reasoning-parser
    disable_log_stats: bool = False         # no periodic stats line (api/stats_logger.py)
    log_stats_interval: float = 10.0        # seconds between two stats lines
    enable_tokenizer_info_endpoint: bool = False   # GET /tokenizer_info (off, as vLLM)
    max_log_len: int = DEFAULT_MAX_LOG_LEN  # --max-log-len: each value a log line shows
    # --default-chat-template-kwargs: under each request's own chat_template_kwargs.
    default_chat_template_kwargs: dict = field(default_factory=dict)
    disable_fastapi_docs: bool = False      # no /docs, /redoc, /openapi.json

    def __post_init__(self) -> None:
        names = self.served_model_names
        # One name as a bare string would otherwise become a tuple of its characters.
        names = (names,) if isinstance(names, str) else tuple(names)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"served_model_names must be one or more non-empty names, "
                             f"got {self.served_model_names!r}")
        object.__setattr__(self, "served_model_names", names)
        keys = self.api_key
        object.__setattr__(self, "api_key", () if not keys else (keys,) if isinstance(keys, str)
                           else tuple(keys))

    @property
    def served_model_name(self) -> str:
        """The name answers carry (the first served name)."""
        return self.served_model_names[0]


@dataclass
class _Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None


class _ShuttingDown(Exception):
    """Put into every open answer's queue when the server's grace period ends."""


class _Answer:
    """One admitted request in progress: the sequences it holds against
    --max-waiting-requests (n per prompt, until the engine finishes that prompt) and
    the tasks that feed it from the engine. Closed once, by whichever comes first:
    its stream of outputs ends, or its HTTP response is done (a streamed body may
    never start when the client leaves before the first byte). Closing cancels the
    tasks, which aborts the engine requests."""

    def __init__(self, serving: OpenAIServing, num_prompts: int, n: int):
        self.serving = serving
        self.held = [n] * num_prompts   # per prompt: sequences not finished in the engine
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        serving.num_in_flight += n * num_prompts
        serving.answers.add(self)

    def prompt_done(self, i: int) -> None:
        """The engine finished prompt i: its sequences neither run nor wait any more
        (a slow client may still be reading them)."""
        self.serving.num_in_flight -= self.held[i]
        self.held[i] = 0

    def close(self) -> None:
        for i in range(len(self.held)):
            self.prompt_done(i)
        self.serving.answers.discard(self)
        for t in self.tasks:
            t.cancel()


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings, metrics: Metrics):
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.inputs = engine.inputs
        # Sequences (n per prompt) admitted and not finished; event-loop thread only.
        self.num_in_flight = 0
        self.shutting_down = False
        self.answers: set[_Answer] = set()

    @property
    def num_requests(self) -> int:
        """Generation requests admitted and not yet answered (GET /load)."""
        return len(self.answers)

    # ---- checks ----------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        names = self.settings.served_model_names
        if name is not None and name not in names:
            served = ", ".join(f"`{n}`" for n in names)
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"{served}.", "model")

    def check_open(self) -> None:
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "1"})

    def check_size(self, num_prompts: int, n: int) -> None:
        """A 400 for a request that could never be admitted: the client must split it."""
        num_seqs, limit = num_prompts * n, self.settings.max_waiting_requests
        if num_seqs > limit:
            raise APIError(400, f"this request has {num_seqs} sequences (n x prompts); the "
                                f"server admits at most {limit} at a time "
                                f"(--max-waiting-requests)", "n")

    def admit(self, num_prompts: int, n: int) -> _Answer:
        """Admits n sequences per prompt or answers 503 when too many already wait.
        Waiting = sequences admitted and unfinished in the engine, less the running ones
        (the engine's count, of sequences too)."""
        self.check_size(num_prompts, n)
        num_seqs, limit = num_prompts * n, self.settings.max_waiting_requests
        waiting = max(self.num_in_flight - self.engine.stats.num_running, 0)
        if waiting + num_seqs > limit:
            raise APIError(503, f"the server is overloaded: {waiting} sequences are waiting, "
                                f"this request adds {num_seqs} (--max-waiting-requests="
                                f"{limit})", headers={"Retry-After": "1"})
        return _Answer(self, num_prompts, n)

    def end_all_answers(self) -> None:
        """Shutdown: every answer in progress ends now with a 503 (a streamed one with an
        error event and [DONE]); new requests get 503 too."""
        self.shutting_down = True
        for answer in self.answers:
            answer.queue.put_nowait((-1, _ShuttingDown()))

    async def _in_worker(self, req, fn, *args, **kwargs):
        """Runs the input processor off the event loop; its InputErrors become 400s."""
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ValueError as e:
            raise _refused(req, e) from None

    async def _with_grammar(self, req, raw: Request, params: SamplingParams) -> SamplingParams:
        """params with their structured-output grammar compiled, on the compiler's own
        threads (not the pool _in_worker uses: a slow grammar must not hold up requests
        that have none); a client that leaves cancels it."""
        so = params.structured_outputs
        if so is None:
            return params
        try:
            grammar = await self.inputs.grammar_compiler().compile_async(
                so, raw.is_disconnected)
        except ValueError as e:
            raise _refused(req, e) from None
        return replace(params, grammar=grammar)

    # ---- /v1/completions ----------------------------------------------------------------
    def _completion_prompts(self, rid: str, req: CompletionRequest,
                            params: SamplingParams) -> list[EngineRequest]:
        """Worker thread: the request's prompts, one engine request each ("{rid}-{i}")."""
        return [self.inputs.process(f"{rid}-{i}", p, params, priority=req.priority,
                                    cache_salt=req.cache_salt,
                                    add_special_tokens=req.add_special_tokens)
                for i, p in enumerate(_prompt_list(req.prompt))]

    async def completions(self, req: CompletionRequest, raw: Request):
        self.check_open()
        self.check_model(req.model)
        if req.max_tokens == 0 and not req.echo:
            # (vLLM refuses it too) an answer of nothing is surely not what was meant
            raise APIError(400, "max_tokens=0 generates nothing: it is for scoring the prompt, "
                                "with echo=true (and logprobs for its token logprobs)",
                           "max_tokens")
        try:
            params = sampling_params(req, self.settings.generation_defaults,
                                     max_tokens=req.max_tokens, logprobs=req.logprobs,
                                     prompt_logprobs=req.logprobs if req.echo else None)
        except ValueError as e:
            raise bad_request(e)
        rid = f"cmpl-{uuid.uuid4().hex}"
        # before any prompt is processed: a million prompts are not tokenized to be refused
        self.check_size(len(_prompt_list(req.prompt)), params.n)
        params = await self._with_grammar(req, raw, params)
        prompts = await self._in_worker(req, self._completion_prompts, rid, req, params)
        answer = self.admit(len(prompts), params.n)
        stream = self._merged(rid, prompts, params, answer)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(self._completion_chunks(rid, prompts, params, req, stream,
                                                include_usage), answer)
        prompt_lps: dict[int, list] = {}
        try:
            choices = await self._collect(stream, raw, params.n, prompt_lps)
        finally:
            answer.close()
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": int(time.time()),
            "model": self.settings.served_model_name,
            "choices": [self._completion_choice(c, c.index // params.n, prompts, prompt_lps, req)
                        for c in choices],
            "usage": _usage(prompts, choices)})

    def _completion_choice(self, c: _Choice, i: int, prompts: list[EngineRequest],
                           prompt_lps: dict[int, list], req: CompletionRequest) -> dict:
        text, logprobs = c.text, None
        if req.echo:
            text = self._prompt_text(prompts[i]) + text
        if req.logprobs is not None:
            logprobs = _completion_logprobs(
                c.logprobs, req.logprobs, self,
                prompts[i].prompt_token_ids if req.echo else None,
                prompt_lps.get(i))
        return {"index": c.index, "text": text, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def _prompt_text(self, prompt: EngineRequest) -> str:
        if prompt.prompt is not None:
            return prompt.prompt
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(prompt.prompt_token_ids))

    async def _completion_chunks(self, rid, prompts, params, req, stream,
                                 include_usage) -> AsyncIterator[str]:
        created, model, n = int(time.time()), self.settings.served_model_name, params.n
        choices: dict[int, _Choice] = {}
        echoed: set[int] = set()
        prompt_lps: dict[int, list] = {}   # per prompt, once the engine sent them
        offsets: dict[int, int] = {}       # per choice: the text_offset of its next token
        async for i, out in stream:
            if out.prompt_logprobs is not None:   # (with or before the first tokens)
                prompt_lps[i] = out.prompt_logprobs
            for c in out.outputs:
                idx = i * n + c.index
                acc = choices.setdefault(idx, _Choice(idx))
                _accumulate(acc, c)
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
                    logprobs = _completion_logprobs(
                        c.logprobs or [], req.logprobs, self,
                        prompts[i].prompt_token_ids if echo else None, prompt_lps.get(i),
                        offset=start)
                    offsets[idx] = _end_offset(logprobs, start)
                yield _data({"id": rid, "object": "text_completion", "created": created,
                             "model": model, "choices": [{
                                 "index": idx, "text": text, "logprobs": logprobs,
                                 "finish_reason": c.finish_reason,
                                 "stop_reason": c.stop_reason}]})
        if include_usage:
            yield _data({"id": rid, "object": "text_completion", "created": created,
                         "model": model, "choices": [],
                         "usage": _usage(prompts, list(choices.values()))})

    # ---- /v1/chat/completions -------------------------------------------------------------
    def _chat_prompts(self, rid: str, req: ChatCompletionRequest, params: SamplingParams,
                      tools: ToolSetup) -> tuple[list[EngineRequest], bool]:
        """Worker thread: the conversation rendered by the chat template, as one engine
        request ("{rid}-0"), and whether the template opened a think block. Then (with
        --reasoning-parser) a structured output applies after the model closes it."""
        ids = render_chat_prompt(self.inputs, req, chat_template=self.settings.chat_template,
                                 tools=tools.tools, add_special_tokens=req.add_special_tokens,
                                 template_kwargs=self.template_kwargs(req))
        in_reasoning = bool(self.settings.reasoning_parser) and prompt_ends_in_reasoning(
            self.inputs.tokenizer.decode(ids[-16:]))
        if in_reasoning and params.structured_outputs is not None:
            end = self.inputs.tokenize(REASONING_END, add_special_tokens=False)
            params = replace(params, grammar_after_ids=tuple(end))
        return [self.inputs.process(f"{rid}-0", ids, params, priority=req.priority,
                                    cache_salt=req.cache_salt)], in_reasoning

    def template_kwargs(self, req: ChatCompletionRequest | TokenizeRequest) -> dict | None:
        """The server's --default-chat-template-kwargs under the request's own."""
        defaults = self.settings.default_chat_template_kwargs
        return {**defaults, **(req.chat_template_kwargs or {})} if defaults \
            else req.chat_template_kwargs

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self.check_open()
        self.check_model(req.model)
        top = req.top_logprobs
        if top is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        try:
            params = sampling_params(req, self.settings.generation_defaults,
                                     max_tokens=max_tokens,
                                     logprobs=(top or 0) if req.logprobs else None)
            tools = tool_setup(req.tools, req.tool_choice,
                               auto_parser=self.settings.auto_tool_parser,
                               parallel=req.parallel_tool_calls)
            params = _with_tool_constraint(params, tools)
        except ValueError as e:
            raise bad_request(e)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        params = await self._with_grammar(req, raw, params)
        prompts, in_reasoning = await self._in_worker(req, self._chat_prompts, rid, req,
                                                      params, tools)
        reader = self._chat_reader(tools, in_reasoning, response_role(req))
        answer = self.admit(1, params.n)
        stream = self._merged(rid, prompts, params, answer)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(self._chat_chunks(rid, prompts, req, stream, include_usage, reader),
                        answer)
        try:
            choices = await self._collect(stream, raw, params.n)
        finally:
            answer.close()
        readers = [reader() for _ in choices]
        echo = echoed_text(req) if req.echo else ""
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": self.settings.served_model_name,
            "choices": [{"index": c.index, "message": _echoed(r.message(c.text), echo),
                         "logprobs": _chat_logprobs(c.logprobs, top or 0)
                         if req.logprobs else None,
                         "finish_reason": r.finish_reason(c.finish_reason),
                         "stop_reason": c.stop_reason}
                        for c, r in zip(choices, readers)],
            "usage": _usage(prompts, choices)})

    def _chat_reader(self, tools: ToolSetup, in_reasoning: bool, role: str):
        """A factory of ChoiceReaders (one per choice) for this request's answer."""
        name = self.settings.reasoning_parser
        parser = get_reasoning_parser(name) if name else None
        return lambda: ChoiceReader(tools, parser, in_reasoning, role)

    async def _chat_chunks(self, rid, prompts, req, stream, include_usage,
                           reader) -> AsyncIterator[str]:
        created, model = int(time.time()), self.settings.served_model_name
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        choices: dict[int, _Choice] = {}
        readers: dict[int, ChoiceReader] = {}
        echo = echoed_text(req) if req.echo else ""
        async for _, out in stream:
            for c in out.outputs:
                first = c.index not in choices
                acc = choices.setdefault(c.index, _Choice(c.index))
                r = readers.setdefault(c.index, reader())
                _accumulate(acc, c)
                if first:
                    yield _data({**base, "choices": [{
                        "index": c.index, "delta": {"role": r.role, "content": ""},
                        "logprobs": None, "finish_reason": None}]})
                    if echo:   # (vLLM's order: the role, the echo, then the answer)
                        yield _data({**base, "choices": [{
                            "index": c.index, "delta": {"content": echo},
                            "logprobs": None, "finish_reason": None}]})
                logprobs = (_chat_logprobs(c.logprobs, req.top_logprobs or 0)
                            if req.logprobs and c.logprobs else None)
                delta_msg = r.delta(c.text, final=c.finish_reason is not None)
                if not delta_msg and not logprobs and c.finish_reason is None:
                    continue        # held back by a parser: nothing to send yet
                yield _data({**base, "choices": [{
                    "index": c.index, "delta": delta_msg, "logprobs": logprobs,
                    "finish_reason": r.finish_reason(c.finish_reason),
                    "stop_reason": c.stop_reason}]})
        if include_usage:
            yield _data({**base, "choices": [], "usage": _usage(prompts, list(choices.values()))})

    # ---- shared machinery ---------------------------------------------------------------------
    async def _merged(self, rid: str, prompts: list[EngineRequest], params: SamplingParams,
                      answer: _Answer) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Runs every prompt; yields (prompt index, its delta output). params: the
        request's, as the client gave them (for the log)."""
        queue = answer.queue
        trackers = [self.metrics.track(p.num_prompt_tokens, p.sampling_params.n)
                    for p in prompts]
        if not self.settings.disable_log_requests:
            limit = self.settings.max_log_len
            logger.info("request %s: %d prompt(s) of %s tokens, %s", rid, len(prompts),
                        loggable([p.num_prompt_tokens for p in prompts], limit),
                        loggable(params, limit))

        async def pump(i: int, p: EngineRequest) -> None:
            try:
                async for out in self.engine.generate(p):
                    if out.finished:
                        answer.prompt_done(i)
                    queue.put_nowait((i, out))
            except asyncio.CancelledError:
                raise
            except BaseException as e:   # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, e))

        answer.tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
        remaining = len(prompts)
        try:
            while remaining:
                i, out = await queue.get()
                if isinstance(out, BaseException):
                    raise _api_error(out)
                trackers[i].update(out)
                if out.finished:
                    remaining -= 1
                yield i, out
        finally:
            for tracker in trackers:   # what never finished counts as aborted
                tracker.close()
            answer.close()

    async def _collect(self, stream, raw: Request, n: int,
                       prompt_logprobs: dict | None = None) -> list[_Choice]:
        """Gathers a whole (non-streamed) answer; a client that hangs up aborts it.
        Prompt logprobs, when the engine sends them, go into `prompt_logprobs[i]`."""
        choices: dict[int, _Choice] = {}

        async def consume() -> None:
            async for i, out in stream:
                if prompt_logprobs is not None and out.prompt_logprobs is not None:
                    prompt_logprobs[i] = out.prompt_logprobs
                for c in out.outputs:
                    idx = i * n + c.index
                    _accumulate(choices.setdefault(idx, _Choice(idx)), c)

        task = asyncio.create_task(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    task.result()
                    break
                if await raw.is_disconnected():
                    raise asyncio.CancelledError("client disconnected")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await stream.aclose()
        return [choices[k] for k in sorted(choices)]


def _prompt_list(prompt) -> list:
    """The prompts a completions request's `prompt` holds. A bare [] is one empty prompt,
    which the input processor refuses."""
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        return [prompt]
    return prompt


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


def _refused(req, e: ValueError) -> APIError:
    """A 400 for an InputError; a constraint's names the field the request used."""
    if getattr(e, "param", None) == "structured_outputs":
        e.param = constraint_field(req)
    return bad_request(e)


def _api_error(e: BaseException) -> APIError:
    """What the client is told when the engine side of its answer fails."""
    if isinstance(e, ValueError):
        return bad_request(e, "prompt")
    if isinstance(e, _ShuttingDown):
        return APIError(503, "the server is shutting down", headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine stopped: {e}")
    return APIError(500, f"the engine failed on this request: {e}")


# ---- formatting helpers --------------------------------------------------------------------
def _echoed(message: dict, echo: str) -> dict:
    """The whole message with `echo` before its content (as vLLM: after the parsers)."""
    if echo:
        message["content"] = echo + (message.get("content") or "")
    return message


def _accumulate(acc: _Choice, c) -> None:
    acc.text += c.text
    acc.token_ids.extend(c.token_ids)
    if c.logprobs:
        acc.logprobs.extend(c.logprobs)
    if c.finish_reason is not None:
        acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason


def _usage(prompts: list[EngineRequest], choices: list[_Choice]) -> dict:
    prompt_tokens = sum(p.num_prompt_tokens for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _ranked(entry: dict, k: int) -> list[tuple[int, Any]]:
    """The top-k alternatives of one position, most likely first."""
    alts = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    return sorted(alts, key=lambda a: a[1].rank)[:k]


def _token_str(serving: OpenAIServing, tid: int, lp) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    tok = serving.tokenizer
    return tok.decode([tid]) if tok is not None else f"token_id:{tid}"


def _completion_logprobs(entries: list[dict], k: int, serving: OpenAIServing,
                         prompt_ids: list[int] | None = None,
                         prompt_entries: list | None = None, *, offset: int = 0) -> dict:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset
    (each token's, from `offset`: where a streamed chunk starts in the whole answer).

    With echo, the prompt's tokens come first (the first has no logprob)."""
    rows: list[tuple[int, dict | None]] = []
    if prompt_ids is not None:
        rows += [(tid, prompt_entries[pos] if prompt_entries else None)
                 for pos, tid in enumerate(prompt_ids)]
    rows += [(next(iter(entry)), entry) for entry in entries]   # the sampled token is first
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in rows:
        lp = entry[tid] if entry is not None else None
        s = _token_str(serving, tid, lp)
        tokens.append(s)
        token_lps.append(lp.logprob if lp is not None else None)
        tops.append({_token_str(serving, t, v): v.logprob for t, v in _ranked(entry, k)}
                    if entry is not None else None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def _end_offset(logprobs: dict, start: int) -> int:
    """The text_offset after the last token of `logprobs` (start when it has none)."""
    if not logprobs["tokens"]:
        return start
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def _chat_logprobs(entries: list[dict], k: int) -> dict:
    content = []
    for entry in entries:
        chosen = next(iter(entry))
        lp = entry[chosen]
        token = lp.decoded_token or ""
        content.append({
            "token": token, "logprob": lp.logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": v.decoded_token or "", "logprob": v.logprob,
                              "bytes": list((v.decoded_token or "").encode())}
                             for _, v in _ranked(entry, k)]})
    return {"content": content}


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events that close their answer when the response is done, even
    when the body never started (the client left before the first byte)."""

    def __init__(self, body: AsyncIterator[str], answer: _Answer):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.answer = answer

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.answer.close()


def _sse(chunks: AsyncIterator[str], answer: _Answer) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as e:
            yield _data(error_body(e.status, e.message, e.param))
        except Exception as e:  # noqa: BLE001 - a stream cannot change its status any more
            log_unexpected("stream failed", e)
            yield _data(error_body(500, f"internal error: {e}"))
        yield "data: [DONE]\n\n"
    return _EventStream(body(), answer)
