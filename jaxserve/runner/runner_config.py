"""RunnerConfig and DrafterConfig: the ModelRunner's and a model drafter's slices of the
engine's settings, derived once from EngineConfig, the layout and the CachePlan
(jaxserve/build/slices.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.config.speculative import SpeculativeConfig


@dataclass(frozen=True)
class RunnerConfig:
    """num_pages / num_state_slots: per layer, the null page / null slot 0 included
    (build/cache_plan.py; 0 slots: no recurrent layers); num_sliding_pages: the
    sliding-window layers' KV group, pages per layer (0: no such group; the step's inputs
    then carry no sliding slots or page table). context_buckets: bucket the page table's
    width (only the jnp reference attention reads whole rows). vocab_axis: the mesh axis
    the lm_head's logits are split over (the rules table's "vocab"), None: whole.
    max_logprobs: the top entries the sampler and prompt logprobs compute (the engine's
    limit, resolved: no -1), a static width of their programs. speculative_config: rows
    verify drafts it proposes (runner/spec_decode.py); the sampler's row buckets then
    reach max_num_seqs * (1 + num_speculative_tokens)."""
    vocab_size: int
    num_pages: int
    page_size: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    kv_dtype: Any
    num_state_slots: int = 0
    num_sliding_pages: int = 0
    context_buckets: bool = True
    vocab_axis: str | None = None
    max_logprobs: int = MAX_LOGPROBS
    speculative_config: SpeculativeConfig | None = None

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    @property
    def pages_per_req(self) -> int:
        return -(-self.max_model_len // self.page_size)


@dataclass(frozen=True)
class DrafterConfig:
    """A model drafter's slice (runner/drafter.py): method "mtp" or "draft_model"; its KV
    on the target's num_pages pages of page_size, in kv_dtype; max_num_seqs rows of
    pages_per_req pages; num_speculative_tokens drafts a step."""
    method: str
    num_pages: int
    page_size: int
    kv_dtype: Any
    max_num_seqs: int
    pages_per_req: int
    num_speculative_tokens: int
