"""OpenAI request bodies (pydantic) and their translation into SamplingParams.

Unknown fields are ignored, as OpenAI-compatible servers do; vLLM's extra
sampling fields (top_k, min_p, repetition_penalty, ignore_eos, ...) are accepted.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str | list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


Kind = Literal["completion", "chat"]


def sampling_params(req: _SamplingFields, defaults: dict[str, Any], *, max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """Request fields over the served model's defaults (its generation_config) over ours.

    Raises ValueError naming the bad field (SamplingParams validates).
    """
    def pick(name: str, fallback):
        value = getattr(req, name)
        if value is not None:
            return value
        return defaults.get(name, fallback)

    return SamplingParams(
        n=req.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
        top_k=pick("top_k", 0), min_p=pick("min_p", 0.0),
        presence_penalty=pick("presence_penalty", 0.0),
        frequency_penalty=pick("frequency_penalty", 0.0),
        repetition_penalty=pick("repetition_penalty", 1.0), seed=req.seed, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, max_tokens=max_tokens,
        min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens)
