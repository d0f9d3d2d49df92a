"""SchedulerConfig: the scheduler's slice of the engine's settings, derived once from
EngineConfig and the CachePlan (jaxserve/build/slices.py) and validated here."""
from __future__ import annotations

from dataclasses import dataclass

from jaxserve.core.req_pages import window_pages
from jaxserve.core.restore_cost import RestoreCost

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
    drop_last_hit_page: see KVCacheManager (an MTP drafter).
    num_host_pages / num_host_state_slots / num_host_sliding_pages: the prefix cache's host
    tier (0: none; the dummy slot 0 of each included; sliding: a sliding-window group's),
    host_page_bytes / host_state_bytes / host_sliding_page_bytes one slot's bytes,
    restore_cost its restore-or-recompute model (None: always restore).
    max_loras: LoRA adapters resident on the device at once (0: LoRA off;
    core/lora_slots.py).
    encoder_cache_rows / encoder_budget: image embedding rows the runner's encoder cache
    holds, and the most a step encodes (core/encoder_cache.py); 0: the engine serves no
    images. whole_images: a chunk (and a prefix hit) never ends inside an image (Gemma 4)."""
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
    num_host_pages: int = 0
    num_host_state_slots: int = 0
    host_page_bytes: int = 0
    host_state_bytes: int = 0
    num_host_sliding_pages: int = 0
    host_sliding_page_bytes: int = 0
    restore_cost: RestoreCost | None = None
    max_loras: int = 0
    encoder_cache_rows: int = 0
    encoder_budget: int = 0
    whole_images: bool = False

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.num_host_pages and (self.sliding_window is not None) != bool(
                self.num_host_sliding_pages):
            raise ValueError(f"num_host_sliding_pages={self.num_host_sliding_pages}: a host "
                             f"tier has sliding slots exactly when the model has a sliding-"
                             f"window group (sliding_window={self.sliding_window})")
        per_seq = 2 if self.num_speculative_tokens else 1
        if self.num_state_slots and self.num_state_slots - 1 < per_seq * self.max_num_seqs:
            raise ValueError(f"num_state_slots={self.num_state_slots} (the null slot included) "
                             f"< {per_seq} x max_num_seqs + 1 = {per_seq * self.max_num_seqs + 1}"
                             f": every running request of a hybrid model needs {per_seq} "
                             f"state slot(s)")
        if self.sliding_window is not None:
            # A request alone must always fit in the sliding pool too: its window, one
            # step's tokens and the page they may straddle (or its whole length, if less).
            need = min(-(-self.max_len // self.page_size),
                       window_pages(self.sliding_window, self.page_size)
                       + -(-self.max_num_batched_tokens // self.page_size))
            if self.num_sliding_pages - 1 < need:
                raise ValueError(f"num_sliding_pages={self.num_sliding_pages} (the null page "
                                 f"included) < {need + 1}: one request's sliding window and "
                                 f"step need {need} pages")

    @property
    def max_len(self) -> int:
        """The longest a request may grow. A request alone must always fit in the pool,
        or preempting it would loop forever: a pool smaller than max_model_len caps
        lengths too."""
        return min(self.max_model_len, (self.num_pages - 1) * self.page_size)
