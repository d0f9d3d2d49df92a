"""The KV cache manager's host tier (a mixin of KVCacheManager; docs/TIERED_CACHE.md).

Eviction: a cached page the device pool hands out again is copied to the host tier
first, with the snapshot of a hybrid's state at its end when one is kept
(core/host_cache.HostCache.offload); a sliding-window group's pages go to the host's
sliding index as its own pool evicts them. Look-up: a prefix hit goes on past the
device's cached pages into the host tier's; those pages are restored into fresh device
pages, taken with the hit, when the cost model says a restore beats recomputing them. A
hybrid's hit must end where a state is kept: a device snapshot, or a host one (which
came with its page, or alone when the device gave up a snapshot whose page it kept:
`_offload_snapshot`; a hit over device pages alone may then restore just the state); a
sliding group's hit needs its last window's sliding pages, from either tier
(core/sliding_pages.py). A restore's rows reach the device a step ahead of the forward
that reads them: a hit with a host part, or one over pages restored in the step being
scheduled, waits a step (`hit_waits`; the scheduler's core/restoring.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from jaxserve.core.host_cache import HostCache
from jaxserve.core.host_pages import HostPage
from jaxserve.core.page_pool import KVCachePage
from jaxserve.core.req_pages import GLOBAL, SLIDING
from jaxserve.core.request import Request
from jaxserve.core.sched_output import HostCopies
from jaxserve.core.state_snapshots import Snapshot

if TYPE_CHECKING:
    from jaxserve.core.kv_cache_manager import GroupPages
    from jaxserve.core.req_pages import ReqPages


@dataclass(slots=True)
class HostHit:
    """The host part of a prefix hit: the global pages after the device's hit, in order;
    sliding-window pages by page index (those of the hit's window the device lacks); the
    tokens it saves computing (what its restore is priced against); and a hybrid's state
    at the hit's end when no device snapshot has it."""
    pages: list[HostPage]
    sliding: dict[int, HostPage]
    tokens: int
    state: HostPage | None = None


class HostHits:
    """Needs the manager's page_size, pools, req_pages, snapshots (None: not a hybrid) and
    _copy_snapshot."""

    def _init_host(self, host: HostCache | None) -> None:
        self.host = host
        self._host_hits: dict[str, HostHit] = {}   # request id -> its hit's host part
        # (group, page id) of the pages the step being scheduled restores into
        self._sending: set[tuple[int, int]] = set()
        # request id -> the end of its hit, whose device snapshot it takes when it resumes
        self._deferred_states: dict[str, int] = {}
        if host is not None:
            self.pool.on_evict = self._offload_evicted
            if self.snapshots is not None and host.states is not None:
                self.snapshots.on_evict = self._offload_snapshot
            if self.sliding_pool is not None:
                if host.sliding is None:
                    raise ValueError("a sliding-window group needs a host tier with "
                                     "sliding slots")
                self.sliding_pool.on_evict = self._offload_evicted_sliding

    def _offload_evicted(self, page: KVCachePage) -> None:
        snapshot = None if self.snapshots is None else self.snapshots.get(page.page_hash)
        self.host.offload(page.page_hash, page.page_id,
                          None if snapshot is None else snapshot.slot)

    def _offload_snapshot(self, snapshot: Snapshot) -> None:
        """The device gives up a snapshot: to host, if its page is still cached on device
        (one whose page left went with it, or serves no hit). Its slot is written only
        after the coming step's forward, and the copy is dispatched before it."""
        if snapshot.page_hash in self.pool.cached_pages:
            self.host.offload_state(snapshot.page_hash, snapshot.slot)

    def _offload_evicted_sliding(self, page: KVCachePage) -> None:
        self.host.offload_sliding(page.page_hash, page.page_id)

    def _host_match(self, hashes: list[int], num_device: int, max_pages: int
                    ) -> list[HostPage]:
        """The host entries that continue a device hit of num_device pages (which ended on
        a miss before max_pages)."""
        if self.host is None or num_device >= max_pages:
            return []
        return self.host.match(hashes[num_device:max_pages])

    def _note_host_hit(self, request: Request, num_device: int, part: HostHit | None
                       ) -> None:
        """The host part of the request's hit (the device alone giving num_device pages),
        kept for allocate_slots, and counted."""
        if self.host is not None:
            self.host.note_lookup(request.num_tokens - num_device * self.page_size,
                                  part.tokens if part else 0)
        if part is not None:
            self._host_hits[request.request_id] = part
            return
        self._host_hits.pop(request.request_id, None)

    def restore_budget(self, request: Request, most: int) -> int:
        """Prefill tokens of the step's budget that restoring the host part of the
        request's last looked-up hit counts as (0: none), at most `most` (a restore never
        takes a whole step)."""
        part = None if self.host is None else self._host_hits.get(request.request_id)
        return min(self.host.budget_tokens(part.tokens), most) if part else 0

    def hit_waits(self, request: Request, hit: GroupPages) -> bool:
        """Whether the request's last looked-up hit (`hit`: its device pages) is restored
        before it can be computed: it has a host part, or takes pages the step being
        scheduled restores into. Then it is taken in this step (allocate_slots with no
        new token) and computed from the next, after the rows have been scattered."""
        if self.host is None:
            return False
        return request.request_id in self._host_hits or bool(self._sending) and any(
            (g, b.page_id) in self._sending for g, pages in enumerate(hit) for b in pages)

    def resume(self, request: Request) -> bool:
        """A request whose hit waited a step is computed in the coming one: a hybrid's
        state from a device snapshot is copied now (before that step's forward). False:
        the snapshot is gone (evicted, reset); the request must look up again."""
        end = self._deferred_states.pop(request.request_id, None)
        return end is None or self._copy_snapshot(
            request, end, self.req_pages[request.request_id].state_slot)

    def take_host_copies(self) -> HostCopies | None:
        """The scheduled step's host copies (HostCache.take_copies); from the next step
        on, the pages it restores into are read after their scatter."""
        self._sending.clear()
        return self.host.take_copies()

    def fail_host_copies(self) -> None:
        """The step in flight failed: the pages its restores, and the settled step's
        (scattered by it), were to fill forget their hashes; its offloads are dropped,
        its host entries unpinned."""
        for g, page in self.host.unsettled_restores():
            self.pools[g].uncache(page)
        self.host.fail()

    def _pending_host_hit(self, request: Request, rp: ReqPages | None,
                          num_new_computed_tokens: int) -> HostHit | None:
        """The host part of the hit allocate_slots is taking (a new request's only)."""
        if self.host is None or rp is not None or not num_new_computed_tokens:
            return None
        return self._host_hits.get(request.request_id)

    @staticmethod
    def _host_fresh(part: HostHit | None, num_groups: int) -> tuple[int, ...]:
        """Fresh pages per KV group that the hit's host part is restored into."""
        if part is None:
            return (0,) * num_groups
        return (len(part.pages), len(part.sliding))[:num_groups]

    def _take_host_part(self, request: Request, rp: ReqPages, part: HostHit) -> None:
        """After the hit's device pages: its host part goes into fresh pages -- the global
        ones after the device's, the sliding ones in the window's places (the null page
        there) -- and its state, if it has one, into the request's state slot. Its entries
        were pinned first, so these allocations cannot evict them."""
        new = self.pool.get_new_pages(len(part.pages))
        rp.pages[GLOBAL].extend(new)
        rp.ids[GLOBAL].extend(b.page_id for b in new)
        places = sorted(part.sliding)
        fresh = self.sliding_pool.get_new_pages(len(places)) if places else []
        for i, page in zip(places, fresh):
            rp.pages[SLIDING][i], rp.ids[SLIDING][i] = page, page.page_id
        state = (part.state, rp.state_slot) if part.state is not None else None
        restored = [(GLOBAL, b) for b in new] + [(SLIDING, b) for b in fresh]
        self._sending.update((g, b.page_id) for g, b in restored)
        self.host.restore(part.pages, [b.page_id for b in new], state,
                          ([part.sliding[i] for i in places], [b.page_id for b in fresh]),
                          restored)
        del self._host_hits[request.request_id]
