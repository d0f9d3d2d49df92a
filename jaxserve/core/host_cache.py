"""The scheduler's side of the prefix cache's host tier (docs/TIERED_CACHE.md).

The KV cache manager tells it which cached pages the device pool evicts (`offload`) and
which host entries a prefix hit restores into fresh device pages (`pin`, then
`restore`); it turns them into the step's HostCopies, which the runner dispatches before
the step's forward, and settles them when the step's results come back: landed offloads
become visible to look-ups (`commit`), a failed step's are dropped unlanded (`fail`).
Only one step is in flight per scheduler, so everything taken with a step's copies is
settled by that step's commit or fail -- but a restore's rows, sent in its step, are
scattered into their pages by the runner's next dispatch: until the step after it is
settled too, the pages it fills are `unsettled_restores` (a failure forgets them).
A sliding-window KV group (Gemma 4) has an index
of its own (`sliding`): its pages leave the device on their own schedule, and a hit
needs only its last window's. Plain Python: the arrays are the runner's
(jaxserve/runner/host_tier.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from jaxserve.core.host_pages import HostPage, HostPageIndex
from jaxserve.core.page_pool import KVCachePage
from jaxserve.core.restore_cost import RestoreCost
from jaxserve.core.sched_output import HostCopies

if TYPE_CHECKING:
    from jaxserve.core.scheduler_config import SchedulerConfig

# (KV group, device page) a restore fills
RestoredPage = tuple[int, KVCachePage]
# Upper bounds (seconds) of the restore transfer-time histogram's buckets (then +Inf):
# a few pages over a host link take ~0.1 ms, a 30k-token prefix of a large model ~100 ms.
RESTORE_TIME_BUCKETS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


@dataclass(frozen=True, slots=True)
class HostCacheStats:
    """Totals since start: tokens looked up in the host tier (a look-up's tokens past its
    device hit) and found there, pages and state snapshots copied each way, their bytes,
    and the host's time to dispatch restores (the runner's), and the restores' transfer
    times (the runner's runner/transfer_timer.py: counts per RESTORE_TIME_BUCKETS bucket
    then +Inf, and their sum; one per step that sent restores)."""
    queries: int = 0
    hits: int = 0
    pages_offloaded: int = 0
    pages_restored: int = 0
    states_offloaded: int = 0
    states_restored: int = 0
    sliding_pages_offloaded: int = 0
    sliding_pages_restored: int = 0
    bytes_offloaded: int = 0
    bytes_restored: int = 0
    num_pages: int = 0        # host page slots in use (landed or in flight)
    capacity: int = 0         # host page slots, the dummy left out
    sliding_num_pages: int = 0  # the sliding-window index's (Gemma 4; 0: none)
    sliding_capacity: int = 0
    state_num_slots: int = 0  # the state snapshots' index (a hybrid's; 0: none)
    state_capacity: int = 0
    restore_seconds: float = 0.0
    restore_time_buckets: tuple[int, ...] = ()
    restore_time_sum: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def usage(self) -> float:
        return self.num_pages / self.capacity if self.capacity else 0.0

    @property
    def sliding_usage(self) -> float:
        return self.sliding_num_pages / self.sliding_capacity if self.sliding_capacity else 0.0

    @property
    def state_usage(self) -> float:
        return self.state_num_slots / self.state_capacity if self.state_capacity else 0.0


# An entry of one of the tier's indices (pages, states, sliding pages) and that index
Entry = tuple[HostPageIndex, HostPage]


@dataclass
class _Step:
    copies: HostCopies = field(default_factory=HostCopies)
    offloading: list[Entry] = field(default_factory=list)   # offloads to land
    restoring: list[Entry] = field(default_factory=list)    # pinned by restores
    restored: list[RestoredPage] = field(default_factory=list)   # the pages filled


class HostCache:
    """num_slots / num_state_slots / num_sliding_slots: the host tier's (the dummy slot 0 of
    each included; 0 sliding slots: no sliding-window group); page_bytes / state_bytes /
    sliding_page_bytes: one host slot's bytes, for the statistics; cost: restore or
    recompute (None: always restore)."""

    def __init__(self, num_slots: int, num_state_slots: int = 0, *, num_sliding_slots: int = 0,
                 page_bytes: int = 0, state_bytes: int = 0, sliding_page_bytes: int = 0,
                 cost: RestoreCost | None = None) -> None:
        self.index = HostPageIndex(num_slots)
        # a hybrid's state snapshots, by the hash of the page each ends (None: no state)
        self.states = HostPageIndex(num_state_slots) if num_state_slots else None
        self.sliding = HostPageIndex(num_sliding_slots) if num_sliding_slots else None
        self.cost = cost
        self.page_bytes, self.state_bytes = page_bytes, state_bytes
        self.sliding_page_bytes = sliding_page_bytes
        self._next = _Step()        # the step being scheduled
        self._in_flight = _Step()   # dispatched, not yet settled
        self._scattering: list[RestoredPage] = []   # the settled step's: see above
        self.queries = self.hits = 0
        # pages out, pages in, states out, states in, sliding pages out, sliding pages in
        self._counts = [0] * 6

    @classmethod
    def for_config(cls, c: SchedulerConfig) -> HostCache | None:
        """The scheduler's host tier, or None when its config has none."""
        if not c.num_host_pages:
            return None
        return cls(c.num_host_pages, c.num_host_state_slots,
                   num_sliding_slots=c.num_host_sliding_pages, page_bytes=c.host_page_bytes,
                   state_bytes=c.host_state_bytes,
                   sliding_page_bytes=c.host_sliding_page_bytes, cost=c.restore_cost)

    # ---- device -> host ------------------------------------------------------------
    def offload(self, page_hash: int, page_id: int, state_slot: int | None = None) -> None:
        """The device pool evicts page_id (cached as page_hash; state_slot: the snapshot of
        the state at its end, if one is kept): copy it to host, unless it is there."""
        entry = self.index.begin_offload(page_hash)
        if entry is not None:
            self._next.copies.offload_pages.append(page_id)
            self._next.copies.offload_slots.append(entry.slot)
            self._next.offloading.append((self.index, entry))
        if state_slot is not None:
            self.offload_state(page_hash, state_slot)

    def offload_state(self, page_hash: int, state_slot: int) -> None:
        """The snapshot in device state slot state_slot (the state at the end of page
        page_hash) goes to host, unless it is there: with its page, or alone (the device
        gives it up and keeps the page)."""
        entry = self.states.begin_offload(page_hash) if self.states is not None else None
        if entry is not None:
            self._next.copies.offload_state_ids.append(state_slot)
            self._next.copies.offload_state_slots.append(entry.slot)
            self._next.offloading.append((self.states, entry))

    def state_entry(self, page_hash: int) -> HostPage | None:
        """The landed host snapshot of the state at the end of page page_hash, or None."""
        return self.states.lookup(page_hash) if self.states is not None else None

    def offload_sliding(self, page_hash: int, page_id: int) -> None:
        """The sliding group's pool evicts page_id (cached as page_hash): copy it to host,
        unless it is there."""
        entry = self.sliding.begin_offload(page_hash)
        if entry is None:
            return
        self._next.copies.offload_sliding_pages.append(page_id)
        self._next.copies.offload_sliding_slots.append(entry.slot)
        self._next.offloading.append((self.sliding, entry))

    # ---- host -> device ------------------------------------------------------------
    def match(self, page_hashes: list[int]) -> list[HostPage]:
        return self.index.match(page_hashes)

    def note_lookup(self, queried: int, found: int) -> None:
        """A prefix look-up asked the host tier for `queried` tokens and found `found`."""
        self.queries += queried
        self.hits += found

    def worth_restoring(self, num_tokens: int) -> bool:
        return num_tokens > 0 and (self.cost is None or self.cost.worth_restoring(num_tokens))

    def budget_tokens(self, num_tokens: int) -> int:
        """What restoring num_tokens takes of a step's token budget."""
        return self.cost.budget_tokens(num_tokens) if self.cost is not None and num_tokens \
            else 0

    def pin(self, entries: list[HostPage], sliding: list[HostPage] = (),
            state: HostPage | None = None) -> None:
        """A hit is taken: its entries (sliding entries, state entry) stay put until the
        step that restores them ends."""
        taken = [(self.index, e) for e in entries] + [(self.sliding, e) for e in sliding] \
            + ([(self.states, state)] if state is not None else [])
        for index, entry in taken:
            index.pin([entry])
        self._next.restoring += taken

    def restore(self, entries: list[HostPage], page_ids: list[int],
                state: tuple[HostPage, int] | None = None,
                sliding: tuple[list[HostPage], list[int]] = ((), ()),
                restored: Sequence[RestoredPage] = ()) -> None:
        """Copy the pinned entries into device pages page_ids; state: (the pinned state
        entry, the request's state slot); sliding: (sliding entries, the sliding pages
        they go into); restored: the caller's record of the pages filled
        (unsettled_restores)."""
        c = self._next.copies
        c.restore_slots.extend(e.slot for e in entries)
        c.restore_pages.extend(page_ids)
        if state is not None:
            c.restore_state_slots.append(state[0].slot)
            c.restore_state_ids.append(state[1])
        c.restore_sliding_slots.extend(e.slot for e in sliding[0])
        c.restore_sliding_pages.extend(sliding[1])
        self._next.restored.extend(restored)

    # ---- a step's life -------------------------------------------------------------
    def take_copies(self) -> HostCopies | None:
        """The scheduled step's copies (None: none); in flight until commit / fail."""
        step, self._next = self._next, _Step()
        fl = self._in_flight
        fl.offloading += step.offloading
        fl.restoring += step.restoring
        fl.restored += step.restored
        c = step.copies
        counts = (len(c.offload_slots), len(c.restore_slots), len(c.offload_state_slots),
                  len(c.restore_state_slots), len(c.offload_sliding_slots),
                  len(c.restore_sliding_slots))
        self._counts = [a + b for a, b in zip(self._counts, counts)]
        return c if c.num_offloads or c.num_restores else None

    @property
    def restored_in_flight(self) -> list[RestoredPage]:
        """The pages the restores of the step in flight fill."""
        return self._in_flight.restored

    def unsettled_restores(self) -> list[RestoredPage]:
        """The pages that the step in flight's restores, and the settled step's (whose
        rows the step in flight scatters), fill: what a failure of it must forget."""
        return self._scattering + self._in_flight.restored

    def commit(self) -> None:
        """The step ran: its offloads landed (the runner stored them), its restores read
        their entries (their rows were sent; the next step scatters them)."""
        fl, self._in_flight = self._in_flight, _Step()
        self._scattering = fl.restored
        for index, entry in fl.offloading:
            index.finish_offload([entry])
        for index, entry in fl.restoring:
            index.unpin([entry])

    def fail(self) -> None:
        """The step failed: its offloads are dropped unlanded, its entries unpinned."""
        fl, self._in_flight = self._in_flight, _Step()
        self._scattering = []
        for index, entry in fl.offloading:
            index.abort_offload([entry])
        for index, entry in fl.restoring:
            index.unpin([entry])

    def reset(self) -> None:
        for index in (self.index, self.sliding, self.states):
            if index is not None:
                index.reset()

    def stats(self) -> HostCacheStats:
        po, pi, so, si, lo, li = self._counts
        return HostCacheStats(
            queries=self.queries, hits=self.hits, pages_offloaded=po, pages_restored=pi,
            states_offloaded=so, states_restored=si, sliding_pages_offloaded=lo,
            sliding_pages_restored=li,
            bytes_offloaded=po * self.page_bytes + so * self.state_bytes
            + lo * self.sliding_page_bytes,
            bytes_restored=pi * self.page_bytes + si * self.state_bytes
            + li * self.sliding_page_bytes,
            num_pages=len(self.index), capacity=self.index.num_slots - 1,
            sliding_num_pages=len(self.sliding) if self.sliding is not None else 0,
            sliding_capacity=self.sliding.num_slots - 1 if self.sliding is not None else 0,
            state_num_slots=len(self.states) if self.states is not None else 0,
            state_capacity=self.states.num_slots - 1 if self.states is not None else 0)
