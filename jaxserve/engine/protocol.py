"""What "an engine" is to its callers: the Engine protocol and its EngineInfo.

EngineCore (one replica) and DataParallelEngine (D replicas behind one front door)
both satisfy Engine; LLM, AsyncEngine and the server hold an Engine and use only
its members, never a replica's insides. Host only: no jax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from jaxserve.config import EngineConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.scheduler import SchedulerStats
from jaxserve.engine.input_processor import EngineRequest, InputProcessor
from models.config import ModelConfig

if TYPE_CHECKING:   # (the cache plan's module reads model specs, which import jax)
    from jaxserve.build.cache_plan import CachePlan


@dataclass(frozen=True)
class EngineInfo:
    """Facts about an engine, fixed once it is up (weights loaded, cache sized, warmup
    done): what the API, the CLI's start-up log and the planner read.

    A data-parallel engine reports replica 0's facts, which every replica shares
    (num_pages and the weight bytes are per replica), except the warmup figures,
    summed over its replicas, and num_replicas.
    """
    config: EngineConfig          # as the engine runs it: the model resolved to a path
    model_config: ModelConfig
    dtype: str                    # the weights' dtype name, e.g. "bfloat16"
    max_model_len: int
    cache_plan: CachePlan         # one replica's caches (build/cache_plan.py)
    weight_bytes: int             # per replica
    weight_bytes_per_device: int
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]   # every end-of-sequence id (eos_token_id first)
    warmup_seconds: float
    warmup_compilations: int      # XLA compilations warmup asked for ...
    warmup_cache_hits: int        # ... of which the persistent compilation cache had
    warmup_fresh_compilations: int   # ... and of which this process compiled
    num_replicas: int = 1

    @property
    def model(self) -> str:
        return self.config.model

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def num_pages(self) -> int:
        """KV pages per layer of one replica, the null page included."""
        return self.cache_plan.num_pages

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache of one replica holds (the null page holds none)."""
        return self.cache_plan.kv_tokens


@runtime_checkable
class Engine(Protocol):
    """An engine as LLM, AsyncEngine and the server drive it, one thread at a time.

    Requests come in as EngineRequests from `inputs` (InputProcessor.process), the one
    place that validates them; add_request trusts them and refuses only what the
    engine alone can know (an id already in use).
    """
    info: EngineInfo              # its config too (info.config), resolved as it runs
    inputs: InputProcessor
    tokenizer: Any   # a Hugging Face tokenizer, or None (prompts must be token ids)

    def add_request(self, request: EngineRequest) -> None: ...

    def abort_request(self, request_id: str) -> RequestOutput | None: ...

    def has_unfinished_requests(self) -> bool: ...

    def num_unfinished(self) -> int: ...

    def step(self) -> list[RequestOutput]:
        """finish_step(begin_step())."""
        ...

    def begin_step(self) -> Any:
        """Schedules and dispatches a step; returns what finish_step takes."""
        ...

    def finish_step(self, step: Any) -> list[RequestOutput]: ...

    def stats(self) -> SchedulerStats: ...

    def reset_prefix_cache(self) -> None: ...

    def remove_lora(self, lora_int_id: int) -> None: ...

    def shutdown(self) -> None: ...

    @property
    def num_compilations(self) -> int:
        """XLA compilations in this process so far (flat after warmup)."""
        ...
