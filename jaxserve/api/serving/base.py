"""OpenAIServing: the base every endpoint family serves through, one per app
(app.state.serving).

Every prompt of a request becomes one engine request (its n completions are
children inside the engine); their delta outputs are merged into one stream
of choices, indexed prompt_index * n + completion_index as OpenAI does.

Every prompt goes through the input processor (tokenizing, chat-template rendering,
every limit) once, in a worker thread, never on the event loop (a big prompt must
not freeze /health and every other stream) and never in the engine thread. Each
admitted request holds its n * prompts sequences against --max-waiting-requests
until the engine finishes it or its response ends, however it ends (see Answer).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from fastapi import Request

from jaxserve.api.chat_prompt import ChatPromptFields
from jaxserve.api.errors import APIError, bad_request
from jaxserve.api.log_values import loggable
from jaxserve.api.lora_adapters import LoRAAdapters
from jaxserve.api.metrics import Metrics
from jaxserve.api.protocol import constraint_field
from jaxserve.api.serving.choices import Choice, accumulate
from jaxserve.api.settings import ServerSettings
from jaxserve.core.outputs import RequestOutput
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError
from jaxserve.engine.input_processor import EngineRequest
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve")

_DISCONNECT_POLL_S = 0.2


class ShuttingDown(Exception):
    """Put into every open answer's queue when the server's grace period ends."""


class Answer:
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
        self.created = int(time.time())   # the served models' `created`
        # (an engine client without a config, as tests' stubs: LoRA off)
        config = getattr(engine, "config", None)
        self.loras = LoRAAdapters(getattr(config, "lora_modules", None) or (),
                                  bool(getattr(config, "enable_lora", False)), self.inputs)
        # Sequences (n per prompt) admitted and not finished; event-loop thread only.
        self.num_in_flight = 0
        self.shutting_down = False
        self.answers: set[Answer] = set()

    @property
    def num_requests(self) -> int:
        """Generation requests admitted and not yet answered (GET /load)."""
        return len(self.answers)

    # ---- checks ----------------------------------------------------------------------
    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for a
        name the server does not serve."""
        names = self.settings.served_model_names
        if name is None or name in names:
            return None
        adapter = self.loras.get(name)
        if adapter is None:
            served = ", ".join(f"`{n}`" for n in (*names, *self.loras.by_name))
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"{served}.", "model")
        return adapter

    def model_name(self, name: str | None) -> str:
        """What an answer says served it: the adapter asked for, else the model."""
        return name if self.loras.get(name) is not None else self.settings.served_model_name

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

    # ---- admission -------------------------------------------------------------------
    def admit(self, num_prompts: int, n: int) -> Answer:
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
        return Answer(self, num_prompts, n)

    def end_all_answers(self) -> None:
        """Shutdown: every answer in progress ends now with a 503 (a streamed one with an
        error event and [DONE]); new requests get 503 too."""
        self.shutting_down = True
        for answer in self.answers:
            answer.queue.put_nowait((-1, ShuttingDown()))

    # ---- before the engine: inputs -----------------------------------------------------
    async def in_worker(self, req: Any, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Runs the input processor off the event loop; its InputErrors become 400s."""
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ValueError as e:
            raise refused(req, e) from None

    async def with_grammar(self, req: Any, raw: Request,
                           params: SamplingParams) -> SamplingParams:
        """params with their structured-output grammar compiled, on the compiler's own
        threads (not the pool in_worker uses: a slow grammar must not hold up requests
        that have none); a client that leaves cancels it."""
        so = params.structured_outputs
        if so is None:
            return params
        try:
            grammar = await self.inputs.grammar_compiler().compile_async(
                so, raw.is_disconnected)
        except ValueError as e:
            raise refused(req, e) from None
        return replace(params, grammar=grammar)

    def template_kwargs(self, req: ChatPromptFields) -> dict | None:
        """The server's --default-chat-template-kwargs under the request's own."""
        defaults = self.settings.default_chat_template_kwargs
        return {**defaults, **(req.chat_template_kwargs or {})} if defaults \
            else req.chat_template_kwargs

    # ---- the engine's side of an answer ------------------------------------------------
    async def generate(self, rid: str, prompts: list[EngineRequest], params: SamplingParams,
                       answer: Answer) -> AsyncIterator[tuple[int, RequestOutput]]:
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
        answer.tasks = [asyncio.create_task(self._pump(i, p, answer))
                        for i, p in enumerate(prompts)]
        remaining = len(prompts)
        try:
            while remaining:
                i, out = await queue.get()
                if isinstance(out, BaseException):
                    raise api_error(out)
                trackers[i].update(out)
                if out.finished:
                    remaining -= 1
                yield i, out
        finally:
            for tracker in trackers:   # what never finished counts as aborted
                tracker.close()
            answer.close()

    async def _pump(self, i: int, prompt: EngineRequest, answer: Answer) -> None:
        """Feeds prompt i's outputs (or its failure) into the answer's queue."""
        try:
            async for out in self.engine.generate(prompt):
                if out.finished:
                    answer.prompt_done(i)
                answer.queue.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:   # noqa: BLE001 - handed to the consumer
            answer.queue.put_nowait((i, e))

    async def collect(self, stream: AsyncIterator[tuple[int, RequestOutput]], raw: Request,
                      n: int, prompt_logprobs: dict | None = None) -> list[Choice]:
        """Gathers a whole (non-streamed) answer; a client that hangs up aborts it.
        Prompt logprobs, when the engine sends them, go into `prompt_logprobs[i]`."""
        choices: dict[int, Choice] = {}

        async def consume() -> None:
            async for i, out in stream:
                if prompt_logprobs is not None and out.prompt_logprobs is not None:
                    prompt_logprobs[i] = out.prompt_logprobs
                for c in out.outputs:
                    idx = i * n + c.index
                    accumulate(choices.setdefault(idx, Choice(idx)), c)

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


# ---- error mapping -------------------------------------------------------------------------
def refused(req: Any, e: ValueError) -> APIError:
    """A 400 for an InputError; a constraint's names the field the request used."""
    if getattr(e, "param", None) == "structured_outputs":
        e.param = constraint_field(req)
    return bad_request(e)


def api_error(e: BaseException) -> APIError:
    """What the client is told when the engine side of its answer fails."""
    if isinstance(e, ValueError):
        return bad_request(e, "prompt")
    if isinstance(e, ShuttingDown):
        return APIError(503, "the server is shutting down", headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine stopped: {e}")
    return APIError(500, f"the engine failed on this request: {e}")
