"""Request state on the host: tokens, progress, status and chained page hashes."""

from __future__ import annotations

import enum
import time
from typing import Any, Iterable

# Parent value for the first page of a sequence (no parent page).
_ROOT_HASH = 0x5BD1E995


def hash_page_tokens(
    parent_hash: int | None, token_ids: tuple[int, ...], extra: Any = None
) -> int:
    """Chained hash of one full page: depends on every token before it.

    `extra` (a request's salt_key: its cache salt and scope) is only mixed into the
    first page; the chain carries it to every later page.
    """
    # Python's builtin 64-bit tuple hash is fast but not cryptographic: a
    # collision would silently reuse another sequence's KV. With ~1e6 cached
    # pages the accidental odds are ~1e-8; adversarial collisions are possible,
    # so multi-tenant deployments should give tenants distinct cache salts.
    parent = _ROOT_HASH if parent_hash is None else parent_hash
    if extra is None:
        return hash((parent, token_ids))
    return hash((parent, token_ids, extra))


class RequestStatus(enum.IntEnum):
    """Ordered so that every status greater than RUNNING is a finished one."""

    WAITING = 0
    PREEMPTED = 1
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6    # its output broke a constraint it was promised to meet

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.RUNNING

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",    # vLLM's FinishReason.ERROR
}


class Request:
    """One generation request. The scheduler owns and mutates it.

    `sampling_params` is duck-typed; the core reads `max_tokens` (None: up
    to max_model_len), `min_tokens`, `ignore_eos` and `stop_token_ids`.

    Two keys keep its pages apart in the prefix cache, both mixed into the first page's
    hash (so no page of it matches a request without the same keys):
    - cache_salt: a client's (vLLM's field), to isolate tenants; it changes nothing
      else (with prefix caching off nothing is cached).
    - cache_scope: the engine's, for a prefix cache private to one request's n
      completions (they share its id as scope), which applies even with prefix
      caching off.
    - its LoRA adapter's id (lora_request.lora_int_id): KV computed under one adapter
      is never another's, nor the base model's.

    lora_request: its adapter (jaxserve.lora_request.LoRARequest, duck-typed) or None;
    lora_slot: the device slot the scheduler acquired for it while it runs (0: none).
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_ids",
        "arrival_time", "priority", "cache_salt", "cache_scope", "page_size",
        "output_token_ids", "all_token_ids", "num_computed_tokens",
        "num_cached_tokens", "num_preemptions", "status", "stop_reason",
        "page_hashes", "spec_token_ids", "lora_request", "lora_slot", "multi_modal",
        "num_in_flight",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling_params: Any,
        eos_token_id: int | Iterable[int] | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        *,
        page_size: int,
        cache_scope: str | None = None,
        lora_request: Any = None,
        multi_modal: Any = None,
    ) -> None:
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.sampling_params = sampling_params
        # End-of-sequence ids (the tokenizer's, the config's and generation_config's).
        self.eos_token_ids = frozenset(() if eos_token_id is None else (
            (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id))
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.cache_scope = cache_scope
        self.lora_request = lora_request
        self.lora_slot = 0
        self.page_size = page_size
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt)
        self.num_computed_tokens = 0
        # Tokens sampled by dispatched steps, not yet appended (async scheduling: the next
        # step is scheduled before the last one's tokens are back; 0 or 1 at schedule).
        self.num_in_flight = 0
        self.num_cached_tokens = -1  # set when first scheduled
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.page_hashes: list[int] = []
        # Speculative decoding: tokens proposed to follow the last one, verified by the
        # next step that computes it (the runner's proposal; [] when none).
        self.spec_token_ids: list[int] = []
        # Its images (multimodal.front.MultiModalInputs, read as `.images`, each with
        # offset, length and content_hash) or None.
        self.multi_modal = multi_modal if multi_modal is not None and multi_modal.images \
            else None
        self._extend_page_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        return self.status > RequestStatus.RUNNING

    def get_finish_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def append_output_token_ids(self, ids: int | list[int]) -> None:
        if isinstance(ids, int):
            self.output_token_ids.append(ids)
            self.all_token_ids.append(ids)
        else:
            self.output_token_ids.extend(ids)
            self.all_token_ids.extend(ids)
        self._extend_page_hashes()

    @property
    def lora_id(self) -> int:
        """Its adapter's lora_int_id; 0: the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def salt_key(self) -> tuple | None:
        """What the first page's hash mixes in: None for a request with no key (its
        hashes are prompt_page_hashes', the data-parallel router's)."""
        if self.lora_request is not None:
            return self.cache_salt, self.cache_scope, self.lora_request.lora_int_id
        if self.cache_salt is None and self.cache_scope is None:
            return None
        return self.cache_salt, self.cache_scope

    @property
    def images(self) -> tuple:
        """Its images' spans and hashes (multimodal ImageInput), () for a text prompt."""
        return () if self.multi_modal is None else self.multi_modal.images

    def splits_image(self, position: int) -> bool:
        """Whether `position` falls strictly inside an image's placeholder tokens."""
        return any(im.offset < position < im.offset + im.length for im in self.images)

    def _images_in(self, start: int, end: int) -> tuple[str, ...]:
        """Content hashes of the images whose placeholder tokens overlap [start, end)."""
        return tuple(im.content_hash for im in self.images
                     if im.offset < end and im.offset + im.length > start)

    def _extend_page_hashes(self) -> None:
        # Hash only the pages that became full; earlier ones never change. A page holding
        # image tokens mixes in those images' content hashes: the same placeholder ids
        # with other pixels must never share a page (or a state snapshot keyed by it).
        ps = self.page_size
        hashes = self.page_hashes
        tokens = self.all_token_ids
        start = len(hashes) * ps
        while start + ps <= len(tokens):
            parent = hashes[-1] if hashes else None
            extra = self.salt_key if not hashes else None
            if self.multi_modal is not None and (images := self._images_in(start, start + ps)):
                extra = (extra, images)
            hashes.append(hash_page_tokens(parent, tuple(tokens[start:start + ps]), extra))
            start += ps

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
