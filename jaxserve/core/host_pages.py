"""The host tier's bookkeeping: which page hash sits in which host slot (docs/TIERED_CACHE.md).

Pages the device pool evicts are copied to host memory under the same chained page
hash (Request.page_hashes), into one of a fixed number of host page slots. The same
index, over host state slots, keeps a hybrid model's state snapshots
(core/state_snapshots.py) by the hash of the page they end: one travels with its page,
or goes alone when the device gives up a snapshot whose page it keeps; each kind has its
own LRU (a state whose page left both tiers is of no use and ages out). Arrays live
elsewhere (jaxserve/runner/host_tier.py); this is plain Python, so the scheduler can own
it.

Life of an entry: `begin_offload` gives it a slot (evicting the least recently used
unpinned entries if needed) and pins it while the device->host copy is in flight; it
becomes visible to look-ups only at `finish_offload` (the copy landed), or is dropped by
`abort_offload` (the copy is discarded unlanded). A restore pins the entries it reads
(`pin` / `unpin`) so they are not evicted or overwritten under it. `reset` forgets
everything; a pinned entry's slot (an offload in flight: it still lands) comes back
when its last pin goes. Slot 0 of each kind is the dummy that padded copies
read and write, never handed out.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable


@dataclass(slots=True)
class HostPage:
    page_hash: int
    slot: int
    ready: bool = False             # the device->host copy landed
    pins: int = 0                   # copies in flight that read or write its slots
    dropped: bool = False           # forgotten while pinned: slots free at the last unpin


def size_host_tier(budget_bytes: int, page_bytes: int, state_bytes: int = 0,
                   state_share: float = 0.1) -> tuple[int, int]:
    """(page slots, state slots), the dummy slot 0 of each included, that budget_bytes
    hold: state_share of it for state snapshots when the model has any (state_bytes >
    0), the rest for pages. A tier too small for one page of each has no slots (0, 0)."""
    if budget_bytes < 0 or page_bytes <= 0 or state_bytes < 0 or not 0 <= state_share < 1:
        raise ValueError(f"bad host tier sizes: budget {budget_bytes}, page {page_bytes}, "
                         f"state {state_bytes}, state share {state_share}")
    states = int(budget_bytes * state_share) // state_bytes if state_bytes else 0
    pages = (budget_bytes - states * state_bytes) // page_bytes
    if pages < 2 or (state_bytes and states < 2):
        return 0, 0
    return pages, states


def sliding_per_page(page_bytes: int, sliding_bytes: int) -> float:
    """A sliding-window KV group's host slots per page slot: as many bytes for sliding
    pages as for global ones (a cached prefix needs all its global pages but only its
    last window's sliding ones: one window per W * sliding_bytes / page_bytes tokens of
    prefix), at most one per page slot."""
    return min(1.0, page_bytes / sliding_bytes)


def size_sliding_host_tier(budget_bytes: int, page_bytes: int, sliding_bytes: int,
                           per_page: float, state_bytes: int = 0) -> tuple[int, int, int]:
    """size_host_tier for a model with a sliding-window KV group (Gemma 4): (page slots,
    state slots, sliding page slots), per_page sliding slots per page slot (each page
    slot takes its share of their bytes, rounded up: within the budget). (0, 0, 0): the
    tier holds too little."""
    if not 0 < per_page <= 1:
        raise ValueError(f"sliding slots per page slot must be in (0, 1], got {per_page}")
    pages, states = size_host_tier(budget_bytes, page_bytes + math.ceil(per_page * sliding_bytes),
                                   state_bytes)
    sliding = int(pages * per_page)
    return (pages, states, sliding) if sliding >= 2 else (0, 0, 0)


class HostPageIndex:
    """LRU over host slots 1..num_slots-1 (page slots, or state slots)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"a host index needs >= 2 slots (slot 0 is the dummy), got "
                             f"{num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))
        self._lru: OrderedDict[int, HostPage] = OrderedDict()   # front: least recent
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, page_hash: int) -> bool:
        return page_hash in self._lru

    @property
    def num_free(self) -> int:
        return len(self._free)

    # ---- look-ups ----------------------------------------------------------------
    def lookup(self, page_hash: int) -> HostPage | None:
        """The landed entry for page_hash (now the most recently used), or None."""
        page = self._lru.get(page_hash)
        if page is None or not page.ready:
            return None
        self._lru.move_to_end(page_hash)
        return page

    def ready(self, page_hash: int) -> bool:
        """Whether page_hash has a landed entry (its place in the LRU order unchanged)."""
        page = self._lru.get(page_hash)
        return page is not None and page.ready

    def match(self, page_hashes: Iterable[int]) -> list[HostPage]:
        """The landed entries of the longest run of page_hashes from its start."""
        out = []
        for h in page_hashes:
            page = self.lookup(h)
            if page is None:
                break
            out.append(page)
        return out

    # ---- device -> host ------------------------------------------------------------
    def begin_offload(self, page_hash: int) -> HostPage | None:
        """A slot for a page about to be copied here, pinned until finish_offload /
        abort_offload. None: nothing to copy (the hash is here already, or in flight)
        or no room (every entry is pinned)."""
        if page_hash in self._lru:
            self._lru.move_to_end(page_hash)
            return None
        if not self._free and not self._evict_page():
            return None
        page = HostPage(page_hash, self._free.pop(), pins=1)
        self._lru[page_hash] = page
        return page

    def finish_offload(self, pages: Iterable[HostPage]) -> None:
        """Their copies landed: they serve look-ups from now on."""
        for page in pages:
            page.ready = True
            self.unpin([page])

    def abort_offload(self, pages: Iterable[HostPage]) -> None:
        """Their copies must not land (the step failed): they are dropped and their
        slots free at once, so the caller discards the copies, never lands them late."""
        for page in pages:
            self._drop(page)
            self.unpin([page])

    # ---- host -> device ------------------------------------------------------------
    def pin(self, pages: Iterable[HostPage]) -> None:
        """A restore reads these until unpin: they are neither evicted nor reused."""
        for page in pages:
            if not page.ready or page.dropped:
                raise ValueError(f"host page {page.page_hash} is not restorable")
            page.pins += 1

    def unpin(self, pages: Iterable[HostPage]) -> None:
        for page in pages:
            if page.pins <= 0:
                raise ValueError(f"host page {page.page_hash} is not pinned")
            page.pins -= 1
            if page.dropped and page.pins == 0:
                self._free_slots(page)

    def reset(self) -> None:
        """Forget every entry (reset_prefix_cache); pinned ones free their slots when
        their copies end."""
        for page in list(self._lru.values()):
            self._drop(page)

    # ---- eviction ------------------------------------------------------------------
    def _evict_page(self) -> bool:
        for page in self._lru.values():
            if page.pins == 0:
                self._drop(page)
                self.num_evicted += 1
                return True
        return False

    def _drop(self, page: HostPage) -> None:
        if page.dropped:
            return
        page.dropped = True
        del self._lru[page.page_hash]
        if page.pins == 0:
            self._free_slots(page)

    def _free_slots(self, page: HostPage) -> None:
        self._free.append(page.slot)
