"""The KV cache manager's host tier (a mixin of KVCacheManager; docs/TIERED_CACHE.md).

Eviction: a cached page the device pool hands out again is copied to the host tier
first, with the snapshot of a hybrid's state at its end when one is kept
(core/host_cache.HostCache.offload). Look-up: a prefix hit goes on past the device's
cached pages into the host tier's; those pages are restored into fresh device pages --
the first of the pages allocate_slots hands the request, so they count as new pages for
the pool's supply -- when the cost model says a restore beats recomputing them. A
hybrid's hit must end where a state is kept: a device snapshot, or a host entry's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.core.host_cache import HostCache
from jaxserve.core.host_pages import HostPage
from jaxserve.core.page_pool import KVCachePage
from jaxserve.core.request import Request

if TYPE_CHECKING:
    from jaxserve.core.req_pages import ReqPages


class HostHits:
    """Needs the manager's page_size, pool and snapshots (None: not a hybrid)."""

    def _init_host(self, host: HostCache | None) -> None:
        self.host = host
        self._host_hits: dict[str, list[HostPage]] = {}   # request id -> its host part
        if host is not None:
            self.pool.on_evict = self._offload_evicted

    def _offload_evicted(self, page: KVCachePage) -> None:
        snapshot = None if self.snapshots is None else self.snapshots.get(page.page_hash)
        self.host.offload(page.page_hash, page.page_id,
                          None if snapshot is None else snapshot.slot)

    def _host_match(self, hashes: list[int], num_device: int, max_pages: int
                    ) -> list[HostPage]:
        """The host entries that continue a device hit of num_device pages (which ended on
        a miss before max_pages)."""
        if self.host is None or num_device >= max_pages:
            return []
        return self.host.match(hashes[num_device:max_pages])

    def _note_host_hit(self, request: Request, num_device: int, extra: list[HostPage]
                       ) -> None:
        """The host part of the request's hit (after num_device device pages), kept for
        allocate_slots, and counted."""
        if self.host is not None:
            ps = self.page_size
            self.host.note_lookup(request.num_tokens - num_device * ps, len(extra) * ps)
        if extra:
            self._host_hits[request.request_id] = extra
            return
        self._host_hits.pop(request.request_id, None)

    def restore_budget(self, request: Request, most: int) -> int:
        """Prefill tokens of the step's budget that restoring the host part of the
        request's last looked-up hit counts as (0: none), at most `most` (a restore never
        takes a whole step)."""
        extra = None if self.host is None else self._host_hits.get(request.request_id)
        return min(self.host.budget_tokens(len(extra) * self.page_size), most) if extra \
            else 0

    def fail_host_copies(self, requests: dict[str, Request]) -> None:
        """The step in flight failed: the pages its restores were to fill forget their
        hashes, its offloads are dropped, its host entries unpinned."""
        for rid, first in self.host.restored_in_flight:
            if (req := requests.get(rid)) is not None:
                self.uncache_unwritten(req, first, shared_too=True)
        self.host.fail()

    def _pending_host_hit(self, request: Request, rp: ReqPages | None,
                          num_new_computed_tokens: int) -> list[HostPage] | None:
        """The host part of the hit allocate_slots is taking (a new request's only)."""
        if self.host is None or rp is not None or not num_new_computed_tokens:
            return None
        return self._host_hits.get(request.request_id)

    def _state_from_host(self, request: Request, num_pages: int,
                         extra: list[HostPage]) -> bool:
        """Whether a hybrid's hit of num_pages pages takes its state from the host entry at
        its end (no device snapshot there)."""
        if self.snapshots is None or not extra:
            return False
        return self.snapshots.lookup(request.page_hashes[num_pages - 1],
                                     num_pages * self.page_size) is None

    def _restore_host_hit(self, request: Request, rp: ReqPages, extra: list[HostPage],
                          first_page: int, new_ids: list[int], state_from_host: bool) -> None:
        """The hit's host part goes into the request's first new pages (and, state_from_host,
        the state at its end into the request's state slot)."""
        ps = self.page_size
        state = (extra[-1].state_slot, rp.state_slot) if state_from_host else None
        self.host.restore(request.request_id, extra, new_ids[:len(extra)], first_page * ps,
                          state)
        del self._host_hits[request.request_id]
