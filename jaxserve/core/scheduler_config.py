"""SchedulerConfig: the scheduler's slice of the engine's settings, derived once from
EngineConfig and the CachePlan (jaxserve/build/slices.py) and validated here."""
from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """num_pages / num_state_slots / num_snapshot_slots: the cache plan's, the null page
    and null slot included. num_sliding_pages / sliding_window: the sliding-window layers'
    KV group (build/cache_plan.py; 0 / None: the model has none, or they share the global
    pages). num_speculative_tokens: most drafts a decoding request verifies in a step (0:
    no speculative decoding); a hybrid then holds two state slots per request.
    num_lookahead_tokens: a request whose chunk reaches its last token also gets pages for
    this many positions past the chunk (a model drafter writes its KV there).
    drop_last_hit_page: see KVCacheManager (an MTP drafter)."""
    num_pages: int
    page_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    num_state_slots: int = 0
    num_sliding_pages: int = 0
    sliding_window: int | None = None
    num_snapshot_slots: int = 0
    num_speculative_tokens: int = 0
    num_lookahead_tokens: int = 0
    drop_last_hit_page: bool = False

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
