"""The cache plan: the models' per-layer cache specs and a memory budget -> how many KV
pages and recurrent-state slots one replica allocates, and their bytes per device.

KV pages come in groups (jaxserve/core/kv_cache_manager.py): the global layers' pages,
and -- when the model has sliding-window layers -- those layers' own pages. A sliding
layer never reads keys before its window, so its pages go back to the pool as they
leave a request's window: the group needs pages for max_num_seqs windows, not for
every token, and is sized for that first; the global group gets the rest.

One plan, made once: the engine allocates its caches from it (runner/layer_caches.py),
the scheduler's page and state-slot managers are sized by it, and the start-up log
and `python -m jaxserve.plan` print it, so the capacity a user reads is the capacity
the engine runs with. Host only: no jax.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from jaxserve.core.kv_cache_manager import window_pages
from models.cache_spec import CacheSpec, PagedKVSpec, RecurrentStateSpec


@dataclass(frozen=True)
class CachePlan:
    """One replica's caches. Pages and slots are per layer and include the null page /
    null slot 0 (what padding rows read and write); bytes are per device."""
    page_size: int
    num_pages: int                # per global KV layer, the null page included
    num_state_slots: int          # per recurrent layer, the null slot included; 0: none
    bytes_per_page: int           # one page of every global KV layer
    bytes_per_state_slot: int     # one slot of every recurrent layer
    num_kv_layers: int            # global KV layers (that own pages)
    num_state_layers: int
    max_model_len: int
    # The sliding-window layers' KV group (0 pages / None: the model has none).
    num_sliding_pages: int = 0    # per sliding layer, the null page included
    bytes_per_sliding_page: int = 0   # one page of every sliding layer
    num_sliding_layers: int = 0
    sliding_window: int | None = None
    # Hybrid prefix caching: slots for state snapshots (core/state_snapshots.py), in the
    # state arrays after the num_state_slots running ones.
    num_snapshot_slots: int = 0
    # Speculative decoding on a hybrid: each running sequence also holds a backup slot.
    state_slots_per_seq: int = 1

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV pages hold (the null page holds none)."""
        return max(self.num_pages - 1, 0) * self.page_size

    @property
    def global_kv_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    @property
    def sliding_kv_bytes(self) -> int:
        return self.num_sliding_pages * self.bytes_per_sliding_page

    @property
    def kv_bytes(self) -> int:
        """Every KV group's pages."""
        return self.global_kv_bytes + self.sliding_kv_bytes

    @property
    def has_sliding(self) -> bool:
        return self.num_sliding_pages > 0

    @property
    def sliding_pages_per_seq(self) -> int:
        """Most sliding pages a sequence keeps between steps: its window's (a step's
        chunk adds its own while it runs)."""
        return window_pages(self.sliding_window, self.page_size) if self.has_sliding else 0

    @property
    def sliding_saved_bytes(self) -> int:
        """What the sliding layers would take beyond their group keeping every token's
        KV: a page per global page (one page-id space for all KV layers)."""
        return max(self.num_pages * self.bytes_per_sliding_page - self.sliding_kv_bytes, 0)

    @property
    def full_history_kv_tokens(self) -> int:
        """Tokens the same KV memory would hold if the sliding layers kept every token's
        KV too (one page-id space for all KV layers)."""
        per_page = self.bytes_per_page + self.bytes_per_sliding_page
        return max(self.kv_bytes // per_page - 1, 0) * self.page_size if per_page else 0

    @property
    def state_bytes(self) -> int:
        return (self.num_state_slots + self.num_snapshot_slots) * self.bytes_per_state_slot

    @property
    def snapshot_bytes(self) -> int:
        return self.num_snapshot_slots * self.bytes_per_state_slot

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes

    @property
    def has_state(self) -> bool:
        return self.num_state_slots > 0

    @property
    def max_running(self) -> int | None:
        """Sequences the state slots let run at once (None: no recurrent layers)."""
        return (self.num_state_slots - 1) // self.state_slots_per_seq if self.has_state \
            else None

    @property
    def max_concurrency(self) -> float:
        """Sequences of max_model_len tokens the KV pages hold at once."""
        return self.kv_tokens / self.max_model_len

    def fits_one_sequence(self) -> bool:
        return self.num_pages - 1 >= -(-self.max_model_len // self.page_size)

    def with_num_pages(self, num_pages: int) -> CachePlan:
        """The same plan with fewer pages (multi-host: every process takes the least)."""
        return replace(self, num_pages=num_pages)

    def describe(self) -> str:
        """The start-up log's account of the caches."""
        sliding = self.has_sliding
        kind = "global " if sliding else ""
        # A sliding model's two layer types: what a token costs in each.
        per_token = f"{self.bytes_per_page / self.page_size / 2**10:.1f} KiB/token, " \
            if sliding else ""
        kv = (f"KV cache: {self.num_pages - 1} pages x {self.page_size} tokens = "
              f"{self.kv_tokens} tokens in {self.num_kv_layers} {kind}layers ({per_token}"
              f"{self.global_kv_bytes / 2**30:.2f} GiB per device); max concurrency at "
              f"{self.max_model_len} tokens: {self.max_concurrency:.1f}x")
        if sliding:
            kv += (f"; sliding-window KV (window {self.sliding_window}): "
                   f"{self.num_sliding_pages - 1} pages x {self.num_sliding_layers} layers "
                   f"({self.bytes_per_sliding_page / self.page_size / 2**10:.1f} KiB/token, "
                   f"{self.sliding_kv_bytes / 2**30:.2f} GiB per device), at most "
                   f"{self.sliding_pages_per_seq} pages per sequence between steps (a page "
                   f"per token there: {self.full_history_kv_tokens} tokens in this memory)")
        if not self.has_state:
            return kv
        snapshots = (f", + {self.num_snapshot_slots} prefix-cache snapshot slots "
                     f"({self.snapshot_bytes / 2**30:.2f} GiB per device)"
                     if self.num_snapshot_slots else "")
        backups = " (and as many backups, for speculative decoding)" \
            if self.state_slots_per_seq == 2 else ""
        return (f"{kv}; recurrent state: {self.max_running} slots{backups} (+ the null slot)"
                f"{snapshots}"
                f" x {self.num_state_layers} layers ({self.state_bytes / 2**30:.2f} GiB per "
                f"device)")


# Hybrid prefix caching: the snapshots' share of the cache budget, and what a running
# sequence may use (its rolling snapshot and the one at its prompt's end; a shared
# prefix's branch snapshot is one among many sequences).
SNAPSHOT_BUDGET_SHARE = 0.1
SNAPSHOTS_PER_SEQ = 2
# Most snapshots per running sequence whatever the budget: a small model's states are
# so small that its share would make tens of thousands of slots, more than the
# distinct prefixes its pages could ever hold with them.
MAX_SNAPSHOTS_PER_SEQ = 8


def plan_caches(specs: Sequence[CacheSpec], *, model_axis: int, page_size: int,
                max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                num_pages: int | None = None, budget_bytes: int | None = None,
                cap_at_demand: bool = False, prefix_caching: bool = False,
                spec_backups: bool = False) -> CachePlan:
    """Exactly one of num_pages (given: the global group's) and budget_bytes (the memory
    per device the caches may take: state slots first, then the sliding group's pages,
    then the global group's). Every recurrent layer gets a slot per running sequence
    (max_num_seqs) plus the null slot; with prefix_caching, snapshot slots too:
    SNAPSHOT_BUDGET_SHARE of the budget, at most MAX_SNAPSHOTS_PER_SEQ per running
    sequence (given num_pages, or cap_at_demand: SNAPSHOTS_PER_SEQ). cap_at_demand: no more global pages than
    max_num_seqs sequences of max_model_len need (CPU: memory is shared with the host).
    spec_backups: speculative decoding, where a hybrid's running sequence also holds a
    backup of its state (two slots each).
    The plan may not fit one sequence (fits_one_sequence): the planner prints that, the
    engine refuses it (require_one_sequence)."""
    if (num_pages is None) == (budget_bytes is None):
        raise ValueError("plan_caches: give exactly one of num_pages and budget_bytes")
    kv = [s for s in specs if isinstance(s, PagedKVSpec) and s.sliding_window is None]
    sliding = [s for s in specs if isinstance(s, PagedKVSpec) and s.sliding_window is not None]
    state = [s for s in specs if isinstance(s, RecurrentStateSpec)]
    # Every cache is split by head over the model axis (the caller checked it divides).
    per_page = sum(s.bytes_per_token() for s in kv) * page_size // model_axis
    per_sliding_page = sum(s.bytes_per_token() for s in sliding) * page_size // model_axis
    per_slot = sum(s.bytes_per_slot() for s in state) // model_axis
    per_seq = 2 if spec_backups and state else 1
    slots = per_seq * max_num_seqs + 1 if state else 0
    full_length = max_num_seqs * -(-max_model_len // page_size) + 1
    # One group for every sliding layer: the widest window decides when pages leave it.
    window = max((s.sliding_window for s in sliding), default=None)
    num_sliding = 0
    if sliding:
        # Between steps each running sequence keeps at most its window's pages; a step
        # adds its tokens' pages (max_num_batched_tokens of them in all, each sequence's
        # chunk straddling at most one more page), and the null page. Never more than
        # max_num_seqs full-length sequences would need.
        num_sliding = min(max_num_seqs * window_pages(window, page_size)
                          + -(-max_num_batched_tokens // page_size) + max_num_seqs + 1,
                          full_length)
    snapshots = 0
    if state and prefix_caching:
        demand = SNAPSHOTS_PER_SEQ * max_num_seqs
        snapshots = demand if budget_bytes is None else min(
            int(budget_bytes * SNAPSHOT_BUDGET_SHARE) // per_slot,
            MAX_SNAPSHOTS_PER_SEQ * max_num_seqs)
        if cap_at_demand:
            snapshots = min(snapshots, demand)
    if num_pages is None:
        left = budget_bytes - (slots + snapshots) * per_slot - num_sliding * per_sliding_page
        num_pages = max(0, left) // per_page if per_page else 0
        if cap_at_demand:
            num_pages = min(num_pages, full_length)
    return CachePlan(page_size=page_size, num_pages=num_pages, num_state_slots=slots,
                     bytes_per_page=per_page, bytes_per_state_slot=per_slot,
                     num_kv_layers=len(kv), num_state_layers=len(state),
                     max_model_len=max_model_len, num_sliding_pages=num_sliding,
                     bytes_per_sliding_page=per_sliding_page,
                     num_sliding_layers=len(sliding), sliding_window=window,
                     num_snapshot_slots=snapshots, state_slots_per_seq=per_seq)


def require_one_sequence(plan: CachePlan) -> CachePlan:
    """The plan, or ValueError with the fix when one max_model_len sequence does not fit
    (the scheduler could never run it, and preempting would loop)."""
    if plan.fits_one_sequence():
        return plan
    have = max(plan.num_pages - 1, 0)
    need = -(-plan.max_model_len // plan.page_size)
    raise ValueError(
        f"the KV cache holds {have} pages of {plan.page_size} tokens, fewer than one "
        f"sequence of max_model_len={plan.max_model_len} needs ({need}); lower "
        f"max_model_len (to at most {have * plan.page_size}) or give the cache more memory "
        f"(num_pages / kv_cache_memory_bytes / hbm_utilization)")
