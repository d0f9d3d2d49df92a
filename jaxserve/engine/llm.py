"""LLM: offline batch generation with vLLM's names and behaviour."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

from tqdm.auto import tqdm

from jaxserve.core.outputs import RequestOutput
from jaxserve.engine.data_parallel import make_engine
from jaxserve.errors import RequestFailedError
from jaxserve.engine.input_processor import EngineRequest
from jaxserve.engine.llm_kwargs import engine_config
from jaxserve.engine.protocol import Engine
from jaxserve.inputs import TextPrompt, TokensPrompt, parse_prompt
from jaxserve.lora_request import LoRARequest
from jaxserve.multimodal.front import MultiModalInputs
from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:   # for hints only: transformers is heavy and loaded late
    from transformers import PreTrainedTokenizerBase

PromptType = str | TextPrompt | TokensPrompt
# use_tqdm: on/off, or a tqdm-like class to make the bar with (as vLLM's).
UseTqdm = bool | Callable[..., tqdm]


class LLM:
    """`LLM(model=...)`, then `generate(prompts, sampling_params)` or `chat(messages)`.

    Engine arguments are EngineConfig's fields or the keyword form of their vLLM flag
    aliases (block_size=, gpu_memory_utilization=); a few vLLM-only arguments are taken
    where their value is true of jaxserve (engine/llm_kwargs.py); any other is a
    TypeError. `mesh="DxM"` (or data_parallel_size=D, tensor_parallel_size=M) runs D
    data-parallel replicas, each tensor-parallel over M devices.
    A request the engine fails (its step raised) makes `generate` raise
    RequestFailedError (a RuntimeError) after aborting the others; the LLM stays usable.
    """

    def __init__(self, model: str, **engine_args: Any):
        self.engine: Engine = make_engine(engine_config(model, engine_args))
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0   # request ids "0", "1", ...: one per prompt the engine ran

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt page (vLLM's name), so that running the same
        prompts again computes them again, e.g. between benchmark repeats. Pages in use
        keep their contents; only their sharing ends. Always succeeds here."""
        self.engine.reset_prefix_cache()
        return True

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: UseTqdm = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Runs every prompt to the end; outputs in the prompts' order, final whatever
        each SamplingParams.output_kind (that is for streams). use_tqdm: a progress bar
        ("Processed prompts", with the input and output tokens per second), or the tqdm
        class to make it with. lora_request: the LoRA adapter of every prompt, or one per
        prompt (None: the base model); needs LLM(..., enable_lora=True)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} "
                             "prompts; give one, or one per prompt")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = _per_prompt_loras(lora_request, len(prompts))
        # Process (validate) everything before adding anything, so a bad prompt harms
        # no other; the ids are taken only once all passed.
        requests = [self._process(str(self._next_id + i), p, sp,
                                  0 if priority is None else priority[i], loras[i])
                    for i, (p, sp) in enumerate(zip(prompts, sampling_params))]
        self._next_id += len(requests)
        order = {}
        for req in requests:
            order[req.request_id] = len(order)
            self.engine.add_request(req)
        return self._run(order, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: UseTqdm = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """chat_template_kwargs: extra template variables (vLLM's name), e.g.
        {"enable_thinking": False}; tools: OpenAI tool definitions for the template (the
        output is the model's text: parse it, or force a call with structured_outputs);
        continue_final_message: the model goes on with the last message (with
        add_generation_prompt=False)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        rendered = [self.engine.inputs.render_chat_mm(
            conv, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=chat_template_kwargs, tools=tools) for conv in conversations]
        prompts = [_Rendered(ids, mm) for ids, mm in rendered]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def _process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                 priority: int, lora: LoRARequest | None = None) -> EngineRequest:
        """Text, a TextPrompt or a TokensPrompt (jaxserve/inputs.py), through the
        engine's input processor."""
        inputs = self.engine.inputs
        if isinstance(prompt, _Rendered):    # a chat, rendered by chat()
            return inputs.process(request_id, prompt.ids, params, priority=priority,
                                  multi_modal=prompt.multi_modal, lora_request=lora)
        prompt, text, salt, images = parse_prompt(prompt)
        multi_modal = None
        if images:
            ids = inputs.tokenize(prompt) if isinstance(prompt, str) else prompt
            if isinstance(prompt, str):
                text = prompt
            prompt, multi_modal = inputs.image_front.expand(ids, images, "multi_modal_data")
        return inputs.process(request_id, prompt, params, text=text, priority=priority,
                              cache_salt=salt, multi_modal=multi_modal, lora_request=lora)

    def _run(self, order: dict[str, int], use_tqdm: UseTqdm) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = _ProgressBar(len(order), use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.error is not None:
                        # The engine already dropped it; the rest are aborted below, so
                        # the engine is clean for the next call.
                        e = RequestFailedError(out.request_id, out.error)
                        e.add_note(f"prompt {order.get(out.request_id)} of this generate() call")
                        raise e
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.finished(out)
        except BaseException:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return results


def _per_prompt_loras(lora_request: Any, n: int) -> list[LoRARequest | None]:
    """generate()'s lora_request as one entry per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} LoRA requests for {n} prompts; give one, or "
                         f"one per prompt")
    return loras


class _Rendered(NamedTuple):
    """A conversation chat() rendered: its ids (image placeholders expanded) and images."""
    ids: list[int]
    multi_modal: MultiModalInputs | None


class _ProgressBar:
    """vLLM's bar: prompts done, and as a postfix the input and output tokens per second
    so far (the finished requests' tokens over the elapsed time)."""

    def __init__(self, total: int, use_tqdm: UseTqdm):
        make = use_tqdm if callable(use_tqdm) else tqdm
        self.bar = make(total=total, desc="Processed prompts", dynamic_ncols=True,
                        disable=not use_tqdm,
                        postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        self.input_tokens = 0
        self.output_tokens = 0

    def finished(self, out: RequestOutput) -> None:
        self.input_tokens += len(out.prompt_token_ids or ())
        self.output_tokens += sum(len(c.token_ids) for c in out.outputs)
        elapsed = self.bar.format_dict.get("elapsed") or 0.0
        if elapsed > 0:
            self.bar.postfix = (f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, "
                                f"output: {self.output_tokens / elapsed:.2f} toks/s")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
