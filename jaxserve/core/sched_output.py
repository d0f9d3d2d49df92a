"""What the scheduler hands the runner each step: a diff against the runner's batch.

The runner keeps a persistent batch (jaxserve/runner/input_batch.py): one row per
request it holds, with the request's pages, tokens and sampling settings. So a step
sends new requests whole (first scheduled, or resumed after a preemption, which
dropped their row) and running ones as deltas: the pages appended and how many tokens
to compute. Running requests carry no token ids: every output they have was sampled
by this runner (multi-host: by every host's runner, from the same replicated result),
and the tokens they compute next are those outputs. Finished and preempted ids tell
the runner which rows to drop, before it adds the new ones.

Pages come per KV group (jaxserve/core/kv_cache_manager.py): the global layers', then,
when the model's sliding-window layers have a pool of their own, theirs; the lists have
equal lengths. Sliding pages given back as they leave a request's window are not sent:
the runner keeps their stale ids in its page-table row, which is safe because attention
never reads a page wholly before the window (and a freed page only ever holds finite
values). A new request's sliding list has the null page 0 before its window.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Iterator

from jaxserve.core.encoder_cache import EncoderJob

# One list of page ids per KV group, in group order.
GroupPageIds = tuple[list[int], ...]


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the runner does not hold yet, whole."""
    req_id: str
    prompt_token_ids: list[int]   # a reference; read-only by contract
    output_token_ids: list[int]   # a copy: outputs so far ([] unless resumed after preemption)
    sampling_params: Any
    page_ids: GroupPageIds      # copies of its page ids per KV group, in order
    num_computed_tokens: int      # tokens already in the KV cache (prefix-cache hit)
    num_new_tokens: int           # tokens to compute this step
    state_slot: int = 0           # hybrid models: its recurrent-state slot (0 = none)
    lora_slot: int = 0            # its LoRA adapter's device slot (0 = the base model)
    multi_modal: Any = None       # its images (multimodal MultiModalInputs), or None


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """Requests the runner holds from an earlier step, as columns (one entry each)."""
    req_ids: list[str]
    num_computed_tokens: list[int]   # position of the first token to compute
    num_new_tokens: list[int]        # tokens to compute this step
    new_page_ids: list[GroupPageIds]   # pages appended this step per group (mostly empty)

    @staticmethod
    def empty() -> CachedRequestData:
        return CachedRequestData([], [], [], [])


@dataclass(frozen=True, slots=True)
class HostCopies:
    """One step's copies between the device caches and the host tier (core/host_cache.py),
    dispatched before its forward, offloads first (a restore may write a page an offload
    reads). Offloads: device page offload_pages[i] (in every KV array) into host slot
    offload_slots[i], device state slot offload_state_ids[j] (a snapshot) into host state
    slot offload_state_slots[j]. Restores: host slot restore_slots[i] into device page
    restore_pages[i], host state slot restore_state_slots[j] into the request's state slot
    restore_state_ids[j]. A sliding-window KV group (Gemma 4) has its own page ids and host
    slots: offload_sliding_pages[k] into offload_sliding_slots[k], restore_sliding_slots[k]
    into restore_sliding_pages[k]."""
    offload_pages: list[int] = field(default_factory=list)
    offload_slots: list[int] = field(default_factory=list)
    offload_state_ids: list[int] = field(default_factory=list)
    offload_state_slots: list[int] = field(default_factory=list)
    restore_slots: list[int] = field(default_factory=list)
    restore_pages: list[int] = field(default_factory=list)
    restore_state_slots: list[int] = field(default_factory=list)
    restore_state_ids: list[int] = field(default_factory=list)
    offload_sliding_pages: list[int] = field(default_factory=list)
    offload_sliding_slots: list[int] = field(default_factory=list)
    restore_sliding_slots: list[int] = field(default_factory=list)
    restore_sliding_pages: list[int] = field(default_factory=list)

    @property
    def num_offloads(self) -> int:
        return len(self.offload_slots) + len(self.offload_state_slots) + \
            len(self.offload_sliding_slots)

    @property
    def num_restores(self) -> int:
        return len(self.restore_slots) + len(self.restore_state_slots) + \
            len(self.restore_sliding_slots)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    num_scheduled_tokens: int       # all requests' tokens this step
    preempted_req_ids: list[str]    # rows to drop: the requests come back as new ones
    finished_req_ids: list[str]     # finished (incl. aborted, failed) since the last schedule()
    # Hybrid prefix caching: (src, dst) recurrent-state slot copies, applied in order in
    # every linear-attention layer. Restores before this step's forward (a snapshot into
    # a request's slot), saves after it (a request's slot, at the end of its chunk, into
    # a snapshot). At most max_num_seqs of each, and only in a step that computes a row.
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: req_id -> the draft tokens its row computes after its known
    # tokens (running requests only; their count is in num_new_tokens).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # The prefix cache's host tier: this step's offloads and restores (None: no tier).
    host_copies: HostCopies | None = None
    # Requests taken this step whose hits it restores: computed from the next step
    # (core/restoring.py); a failure of this step fails them with its own.
    restoring_req_ids: list[str] = field(default_factory=list)
    # LoRA: (slot, adapter) whose weights the runner writes into that device slot before
    # this step (the adapter is a LoRARequest: plain data a follower host loads too).
    lora_loads: list[tuple[int, Any]] = field(default_factory=list)
    # Images: what the runner encodes into its encoder cache before this step's forward,
    # after forgetting the evicted hashes (core/encoder_cache.py).
    encoder_jobs: list[EncoderJob] = field(default_factory=list)
    encoder_frees: list[str] = field(default_factory=list)

    @property
    def req_ids(self) -> list[str]:
        """Every scheduled request: running ones in order, then the new ones."""
        return self.cached_reqs.req_ids + [r.req_id for r in self.new_reqs]

    def scheduled(self) -> Iterator[tuple[str, int, int]]:
        """(req_id, num_computed_tokens, num_new_tokens) of each scheduled request."""
        c = self.cached_reqs
        return chain(zip(c.req_ids, c.num_computed_tokens, c.num_new_tokens),
                     ((r.req_id, r.num_computed_tokens, r.num_new_tokens)
                      for r in self.new_reqs))

    @property
    def is_empty(self) -> bool:
        """Nothing for a runner to do (no rows to add, advance or drop)."""
        return not (self.new_reqs or self.cached_reqs.req_ids or self.preempted_req_ids
                    or self.finished_req_ids or self.lora_loads)
