"""One choice of an answer, accumulated from the engine's delta outputs; a request's usage."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxserve.core.outputs import CompletionOutput
from jaxserve.engine.input_processor import EngineRequest


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None


def accumulate(acc: Choice, c: CompletionOutput) -> None:
    """Adds one delta of a choice to what came before it."""
    acc.text += c.text
    acc.token_ids.extend(c.token_ids)
    if c.logprobs:
        acc.logprobs.extend(c.logprobs)
    if c.finish_reason is not None:
        acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason


def usage(prompts: list[EngineRequest], choices: list[Choice]) -> dict:
    prompt_tokens = sum(p.num_prompt_tokens for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
