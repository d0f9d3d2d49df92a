"""LLM: offline batch generation with vLLM's names and behaviour."""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.engine.data_parallel import make_engine
from jaxserve.engine.errors import RequestFailedError
from jaxserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """`LLM(model=...)`, then `generate(prompts, sampling_params)` or `chat(messages)`.

    Engine arguments are EngineConfig's fields; `block_size` is an alias of `page_size`.
    `mesh="DxM"` runs D data-parallel replicas, each tensor-parallel over M devices.
    A request the engine fails (its step raised) makes `generate` raise
    RequestFailedError (a RuntimeError) after aborting the others; the LLM stays usable.
    """

    def __init__(self, model: str, **engine_args: Any):
        if "block_size" in engine_args:
            engine_args["page_size"] = engine_args.pop("block_size")
        self.engine = make_engine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt page (vLLM's name), so that running the same
        prompts again computes them again, e.g. between benchmark repeats. Pages in use
        keep their contents; only their sharing ends. Always succeeds here."""
        self.engine.reset_prefix_cache()
        return True

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
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
        # Validate everything before adding anything, so a bad prompt harms no other.
        requests = []
        for i, (p, sp) in enumerate(zip(prompts, sampling_params)):
            text, ids = self._tokenize(p)
            self.engine.validate(ids, sp)
            requests.append((text, list(ids), sp, 0 if priority is None else priority[i]))
        order = {}
        for text, ids, sp, prio in requests:
            rid = str(next(self._ids))
            order[rid] = len(order)
            self.engine.add_request(rid, ids, sp, prompt=text, priority=prio)
        return self._run(order, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """chat_template_kwargs: extra template variables (vLLM's name), e.g.
        {"enable_thinking": False}."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.engine.inputs.render_chat(
            conv, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            template_kwargs=chat_template_kwargs)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Text or {'prompt_token_ids': [...]} -> (text, ids); the ids are checked with
        the sampling parameters in generate (the input processor's process)."""
        if isinstance(prompt, str):
            return prompt, self.engine.inputs.tokenize(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), prompt["prompt_token_ids"]
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        raise ValueError(f"a prompt must be a str or a dict with 'prompt_token_ids', got "
                         f"{type(prompt).__name__}")

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm)
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
                        bar.update(1)
        except BaseException:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return results
