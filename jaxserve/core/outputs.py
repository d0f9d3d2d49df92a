"""Request outputs shaped like vLLM's (``vllm.outputs`` / ``vllm.sequence.Logprob``).

Host-only, no jax. Mutable on purpose: the engine extends them step by step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.core.request_metrics import RequestMetrics


@dataclass
class Logprob:
    """Log-probability of one token; `rank` 1 = most likely in the vocabulary."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: {token_id: Logprob}, the sampled token included.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing predicts it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of the n completions of a request.

    finish_reason: None while running, else "stop" (EOS, stop token or stop
    string) or "length" (max_tokens / max_model_len) or "abort" or "error" (its
    structured-output constraint failed part-way: the text does not satisfy it).
    stop_reason: the stop string or stop token id that ended it, None for EOS.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What `LLM.generate` returns and the engine streams, per request.

    error: None, or why the engine failed this request: the type and text of the
    exception its step raised (e.g. "OverflowError: ..."). Such an output is the
    request's last (finished=True; unfinished completions have finish_reason
    "abort"); the engine goes on with its other requests. LLM.generate and
    AsyncEngine.generate raise RequestFailedError for it instead of returning it.
    metrics: the request's timeline as of this output (a copy: later steps do not
    change it), filled by the engine.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
    error: str | None = None
