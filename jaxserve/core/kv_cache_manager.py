"""Per-request page tables on top of the PagePools, with prefix-cache lookup.

KV groups: every KV layer shares one page-id space (group GLOBAL), except the
sliding-window layers when the cache plan gives them a pool of their own (group
SLIDING). A sliding layer never reads a key more than sliding_window - 1 positions
before its query, so that group gives a request's pages back once they lie wholly
before its window. Both groups' page lists have the same length (entry i holds
positions [i * page_size, (i + 1) * page_size) in each); the sliding list has the null
page 0 where it gave a page back, or never needed one (a prefix hit).
"""

from __future__ import annotations

from jaxserve.core.host_cache import HostCache
from jaxserve.core.host_pages import HostPage
from jaxserve.core.host_hits import HostHit, HostHits
from jaxserve.core.page_pool import PagePool, KVCachePage
from jaxserve.core.req_pages import GLOBAL, SLIDING, PrefixCacheStats, ReqPages, window_pages
from jaxserve.core.request import Request
from jaxserve.core.sliding_pages import SlidingPages
from jaxserve.core.state_slots import StateSlotPool
from jaxserve.core.state_snapshots import SnapshotCache


# Pages per KV group, in group order.
GroupPages = tuple[list[KVCachePage], ...]


class KVCacheManager(SlidingPages, HostHits):
    """Hands out fixed-size pages to requests; shares full pages by hash.

    Caching applies when `enable_caching` is on, or per request when it has a
    `cache_scope` (n>1 siblings share their prompt pages even with caching off; the
    scope keeps those pages invisible to every other request). A request's
    `cache_salt` only changes its hashes: salted pages match only the same salt.

    Hybrid models (num_state_slots > 0: the cache plan's count, the null slot 0
    included) also give each request one recurrent-state slot (a StateSlotPool) with
    its first pages, returned with them. Their requests share pages only with
    num_snapshot_slots > 0 (core/state_snapshots.py): a hit must also restore the
    recurrent state at its end, so it stops at the last page that has a snapshot.

    num_sliding_pages > 0 (with sliding_window): the sliding-window layers' KV group,
    a second pool of that many pages (the null page included). Both groups register
    full pages under the same chained hashes (Request.page_hashes).

    spec_backups (hybrid models with speculative decoding): each request holds a second
    state slot, where its state is copied before a step that verifies drafts; when some
    are rejected it is copied back and the accepted tokens are computed again
    (backup_state / rollback_state).

    drop_last_hit_page (speculative decoding with an MTP layer): a prefix hit leaves out
    its last page, whose last position's MTP KV was computed from the token after the
    page, which the page's hash does not cover (another request's continuation).
    whole_images (Gemma 4): a hit never ends inside an image (its tokens see each other).

    host: the prefix cache's host tier (core/host_hits.py), None: evicted pages are
    dropped.
    """

    def __init__(self, num_pages: int, page_size: int, enable_caching: bool = True,
                 num_state_slots: int = 0, *, num_sliding_pages: int = 0,
                 sliding_window: int | None = None, num_snapshot_slots: int = 0,
                 spec_backups: bool = False, drop_last_hit_page: bool = False,
                 host: HostCache | None = None, whole_images: bool = False) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if num_state_slots < 0:
            raise ValueError(f"num_state_slots must be >= 0, got {num_state_slots}")
        if (num_sliding_pages > 0) != (sliding_window is not None):
            raise ValueError(f"give num_sliding_pages and sliding_window together, got "
                             f"{num_sliding_pages} and {sliding_window}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_caching = enable_caching
        self.state_slots = StateSlotPool(num_state_slots) if num_state_slots else None
        self.spec_backups = spec_backups and num_state_slots > 0
        self.drop_last_hit_page, self.whole_images = drop_last_hit_page, whole_images
        # Hybrid prefix caching: snapshot slots follow the running requests' slots.
        self.snapshots = SnapshotCache(num_state_slots, num_snapshot_slots) \
            if num_state_slots and num_snapshot_slots else None
        self._branch: dict[str, int] = {}   # request id -> where to keep a branch snapshot
        # The coming step's copies before its forward: (snapshot, slot) of prefix hits,
        # (backup, slot) and (slot, backup) of speculative decoding.
        self._restores: list[tuple[int, int]] = []
        # The pools always cache; this manager decides which requests take part.
        self.pool = PagePool(num_pages, enable_caching=True)
        self.sliding_pool = PagePool(num_sliding_pages) if num_sliding_pages else None
        self.sliding_window = sliding_window
        self.pools: tuple[PagePool, ...] = (self.pool,) if self.sliding_pool is None else \
            (self.pool, self.sliding_pool)
        self.req_pages: dict[str, ReqPages] = {}
        self._queries = 0
        self._hits = 0
        self._init_host(host)

    @property
    def num_groups(self) -> int:
        return len(self.pools)

    def _no_pages(self) -> GroupPages:
        return tuple([] for _ in self.pools)

    def _shares_pages(self, request: Request) -> bool:
        """Whether the request takes part in the prefix cache (hybrid models: only with
        snapshot slots)."""
        return (self.state_slots is None or self.snapshots is not None) and (
            self.enable_caching or request.cache_scope is not None)

    def get_computed_pages(self, request: Request) -> tuple[GroupPages, int]:
        """Longest cached prefix of the request, in whole pages: (its pages per KV group,
        its length in tokens). At least one token is always left to compute, since its
        logits are needed."""
        if not self._shares_pages(request):
            return self._no_pages(), 0
        # Pages fully inside the first num_tokens - 1 tokens.
        max_pages = (request.num_tokens - 1) // self.page_size
        hashes = request.page_hashes
        cached = self.pool.cached_pages
        hit: list[KVCachePage] = []
        for i in range(min(max_pages, len(hashes))):
            b = cached.get(hashes[i])
            if b is None:
                break
            hit.append(b)
        while self.whole_images and hit and request.splits_image(len(hit) * self.page_size):
            hit.pop()
        extra = self._host_match(hashes, len(hit), min(max_pages, len(hashes)))
        if self.drop_last_hit_page and (extra or hit):   # the hit's last, on either tier
            (extra or hit).pop()
        if self.sliding_pool is not None:
            pages, part, num_device = self._sliding_hit(request, hashes, hit, extra)
        else:
            state = None
            if self.snapshots is not None:
                hit, extra, state = self._snapshot_hit(request, hashes, hit, extra)
            if extra and not self.host.worth_restoring(len(extra) * self.page_size):
                extra = []   # recomputing them is cheaper
                if self.snapshots is not None:
                    hit, _, state = self._snapshot_hit(request, hashes, hit, extra)
            pages, num_device = (hit,), len(hit)
            part = HostHit(extra, {}, len(extra) * self.page_size, state) \
                if extra or state else None
        self._note_host_hit(request, num_device, part)
        num_tokens = (len(pages[GLOBAL]) + (len(part.pages) if part else 0)) * self.page_size
        self._queries += request.num_tokens
        self._hits += num_device * self.page_size   # the device's (vLLM's "local")
        return pages, num_tokens

    def _snapshot_hit(self, request: Request, hashes: list[int], hit: list[KVCachePage],
                      extra: list[HostPage]
                      ) -> tuple[list[KVCachePage], list[HostPage], HostPage | None]:
        """A hybrid's hit: the longest prefix of the cached pages (device, then host: extra)
        with a snapshot of the state at its end -- a device one, else a host one (then
        returned: the hit restores it). Cached pages past it mark a branch point: the
        request keeps a snapshot there while it computes them again, for the next request
        that shares them (a shared system prompt hits from the third request on)."""
        ps, d = self.page_size, len(hit)
        n = total = d + len(extra)
        state = None
        while n and self.snapshots.lookup(hashes[n - 1], n * ps) is None:
            state = None if self.host is None else self.host.state_entry(hashes[n - 1])
            if state is not None:
                break
            n -= 1
        if total > n:
            self._branch[request.request_id] = total * ps
        else:
            self._branch.pop(request.request_id, None)
        return hit[:n], extra[:max(n - d, 0)], state

    def state_cut(self, request: Request, start: int) -> int | None:
        """Hybrid prefix caching: the first position past `start` where the request's
        chunk must end so that its state there can be kept -- its branch point, or the
        end of its prompt's last full page (its rolling snapshot: the next turn of a
        chat restarts there) -- or None."""
        if self.snapshots is None or not self._shares_pages(request):
            return None
        ps = self.page_size
        cuts = [c for c in (self._branch.get(request.request_id),
                            request.num_prompt_tokens // ps * ps) if c and c > start]
        return min(cuts, default=None)

    def plan_state_saves(self, scheduled: list[tuple[Request, int]]) -> None:
        """The coming step's snapshots, for each (request, the page boundary its chunk
        ends at): at its branch point or its prompt's last full page a kept snapshot,
        elsewhere its rolling one."""
        snaps, ps = self.snapshots, self.page_size
        for req, end in scheduled:
            if not self._shares_pages(req):
                continue
            rid = req.request_id
            rp = self.req_pages.get(rid)
            page_hash = req.page_hashes[end // ps - 1]
            if self._branch.get(rid) == end:
                del self._branch[rid]
                snaps.save_branch(rp.state_slot, page_hash, end)
            elif end == req.num_prompt_tokens // ps * ps:
                # Kept apart from the rolling one: a thinking model's next turn drops
                # this turn's reasoning, so it diverges right after this prompt.
                snaps.save_branch(rp.state_slot, page_hash, end)
            else:
                snaps.save_rolling(rid, rp.state_slot, page_hash, end)

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(restores before the coming step's forward, saves after it), as (src slot,
        dst slot) pairs; the saves become usable once the step has run (commit)."""
        restores, self._restores = self._restores, []
        return restores, [] if self.snapshots is None else self.snapshots.pending_copies()

    def backup_state(self, request: Request) -> None:
        """Before a step that verifies drafts: keep the request's state in its backup."""
        rp = self.req_pages[request.request_id]
        self._restores.append((rp.state_slot, rp.backup_slot))

    def rollback_state(self, request: Request) -> None:
        """After that step rejected drafts: its state is the backup again (the accepted
        tokens are computed once more)."""
        rp = self.req_pages[request.request_id]
        self._restores.append((rp.backup_slot, rp.state_slot))

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_pages: GroupPages | None = None,
        num_new_computed_tokens: int = 0,
    ) -> GroupPages | None:
        """Make the request's pages cover num_computed_tokens +
        num_new_computed_tokens + num_new_tokens tokens, in every KV group.
        new_computed_pages: a prefix hit, as get_computed_pages gives it.

        A sliding group first gives back the pages that lie wholly before the request's
        window. num_new_tokens may be 0 only with a hit: its pages alone are taken (a hit
        restored a step ahead, core/host_hits.hit_waits).
        Returns the newly allocated pages per group (the same number in each,
        possibly none), or None, changing nothing, when a pool cannot supply them.
        """
        if num_new_tokens < 0 or not (num_new_tokens or num_new_computed_tokens):
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        rid = request.request_id
        rp = self.req_pages.get(rid)
        ps = self.page_size
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        caches = self._shares_pages(request)
        if rp is not None and not new_computed_pages:
            # Fast path (most decodes): no new page and no page becomes full.
            if total <= len(rp.ids[GLOBAL]) * ps and (
                    not caches or min(total, request.num_tokens) // ps <= rp.num_cached):
                if self.sliding_pool is None:
                    return ([],)
                self._drop_out_of_window(request, rp)
                return [], []
        part = self._pending_host_hit(request, rp, num_new_computed_tokens)
        hit = new_computed_pages if new_computed_pages and (
            new_computed_pages[GLOBAL] or part) else None
        num_have = 0 if rp is None else len(rp.ids[GLOBAL])
        # (a hit's host part is restored into fresh pages taken with the hit)
        num_hit = 0 if hit is None else len(hit[GLOBAL]) + (len(part.pages) if part else 0)
        num_new_pages = -(-total // ps) - num_have - num_hit
        fresh = self._host_fresh(part, self.num_groups)
        if (num_new_pages > 0 or hit) and not self._can_supply(request, rp, hit,
                                                               num_new_pages, fresh):
            return None
        if rp is None:
            rp = self._new_req_pages(rid)
            if rp is None:
                return None
        if hit:   # (a hit taken alone is computed a step later)
            self._take_hit(request, rp, hit, part, defer_state=not num_new_tokens)
        elif self.sliding_pool is not None:
            self._drop_out_of_window(request, rp)
        new_pages = self._no_pages()
        if num_new_pages > 0:
            new_pages = tuple(pool.get_new_pages(num_new_pages) for pool in self.pools)
            for g, pages in enumerate(new_pages):
                rp.pages[g].extend(pages)
                rp.ids[g].extend(b.page_id for b in pages)
        # Register pages that become full with this step's tokens now, so a
        # request scheduled later in the same step can already share them (drafts are
        # not known tokens: a page is full once its known tokens fill it).
        if caches:
            num_full = min(total, request.num_tokens) // ps
            if num_full > rp.num_cached:
                for g, pool in enumerate(self.pools):
                    pool.cache_full_pages(request, rp.pages[g], rp.num_cached, num_full)
                rp.num_cached = num_full
        return new_pages

    def _can_supply(self, request: Request, rp: ReqPages | None, hit: GroupPages | None,
                    num_new_pages: int, fresh: tuple[int, ...]) -> bool:
        """Whether every pool can hand out num_new_pages, and fresh[g] for a hit's host
        part, after taking the hit's pages."""
        for g, pool in enumerate(self.pools):
            supply = pool.free_queue.num_free
            if hit:   # free-but-cached hits leave the free queue when touched
                supply -= sum(1 for b in hit[g] if b.ref_cnt == 0 and b is not pool.null_page)
            if g == SLIDING and rp is not None:   # given back before allocating
                lo, hi = self._out_of_window(request, rp)
                supply += sum(1 for b in rp.pages[SLIDING][lo:hi] if b.ref_cnt == 1)
            if num_new_pages + fresh[g] > supply:
                return False
        return True

    def _new_req_pages(self, rid: str) -> ReqPages | None:
        """A new request's entry, with its state slot (and backup) when the model has
        recurrent state; None when no slot is free."""
        state_slot = backup_slot = 0
        if self.state_slots is not None:
            if self.state_slots.num_free < 1 + self.spec_backups:
                return None
            state_slot = self.state_slots.allocate()
            if self.spec_backups:
                backup_slot = self.state_slots.allocate()
        rp = self.req_pages[rid] = ReqPages(len(self.pools), state_slot, backup_slot)
        return rp

    def _take_hit(self, request: Request, rp: ReqPages, hit: GroupPages,
                  part: HostHit | None, defer_state: bool = False) -> None:
        """A new request's prefix hit: its pages (and a hybrid's state snapshot at the
        hit's end, restored first) become the request's; the host entries of its host
        part stay pinned until the step that restores them ends. defer_state: the
        request is computed a step later, its snapshot copied then (resume)."""
        if rp.pages[GLOBAL]:
            raise ValueError(f"request {request.request_id!r} already has pages; prefix hits "
                             f"only apply to new requests")
        n = len(hit[GLOBAL]) + (len(part.pages) if part else 0)
        from_host = part is not None and part.state is not None
        if part is not None:
            self.host.pin(part.pages, list(part.sliding.values()), part.state)
        if self.snapshots is not None and not from_host:   # restored before the forward
            end = n * self.page_size
            if defer_state:
                self._deferred_states[request.request_id] = end
            elif not self._copy_snapshot(request, end, rp.state_slot):
                raise RuntimeError(f"request {request.request_id!r}: the snapshot its hit "
                                   f"ends on is gone")
        for g, pool in enumerate(self.pools):
            pool.touch(hit[g])
            rp.pages[g].extend(hit[g])
            rp.ids[g].extend(b.page_id for b in hit[g])
        if part is not None:
            self._take_host_part(request, rp, part)
        if self.sliding_pool is not None:
            rp.num_dropped = sum(1 for b in rp.pages[SLIDING] if b.page_id == 0)

    def _copy_snapshot(self, request: Request, end: int, state_slot: int) -> bool:
        """The device snapshot of the request's state at token `end` (a page boundary)
        copied into state_slot before the next forward; False: none is cached."""
        snap = self.snapshots.lookup(request.page_hashes[end // self.page_size - 1], end)
        if snap is None:
            return False
        self.snapshots.use(snap)
        self._restores.append((snap.slot, state_slot))
        return True

    def uncache_unwritten(self, request: Request, num_written_tokens: int,
                          shared_too: bool = False) -> None:
        """Forget the hashes this request registered for pages past its first
        `num_written_tokens` tokens: it was dropped from a step whose tokens
        would have filled them, so their KV will never be written.

        shared_too: also pages others hold. Right when the whole step failed: the
        only other holders of a page registered by that step are requests of the
        same step (a later prefix hit), whose KV write failed as well."""
        rp = self.req_pages.get(request.request_id)
        if rp is None:
            return
        first = num_written_tokens // self.page_size
        for pool, pages in zip(self.pools, rp.pages):
            for b in pages[first:]:
                # ref_cnt == 1: nobody else shares it (shared pages hold valid KV).
                if b.page_hash is not None and (shared_too or b.ref_cnt == 1):
                    pool.uncache(b)

    def free(self, request: Request) -> None:
        """Give back the request's pages tail first (its last are evicted first)."""
        rp = self.req_pages.pop(request.request_id, None)
        if rp is not None:
            for pool, pages in zip(self.pools, rp.pages):
                pool.free_pages(reversed(pages))
            if rp.state_slot:
                self.state_slots.free(rp.state_slot)
                # Copies into its slots would land in another request's after reuse.
                mine = (rp.state_slot, rp.backup_slot)
                self._restores = [p for p in self._restores if p[1] not in mine]
            if rp.backup_slot:
                self.state_slots.free(rp.backup_slot)
        if self.snapshots is not None:
            self.snapshots.release(request.request_id)
            self._branch.pop(request.request_id, None)
        self._host_hits.pop(request.request_id, None)
        self._deferred_states.pop(request.request_id, None)

    def get_page_ids(self, request_id: str, group: int = GLOBAL) -> list[int]:
        """A copy of the request's page ids in one KV group, in order."""
        rp = self.req_pages.get(request_id)
        return [] if rp is None else rp.ids[group][:]

    def get_group_page_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Copies of the request's page ids, one list per KV group."""
        return tuple(self.get_page_ids(request_id, g) for g in range(len(self.pools)))

    def get_state_slot(self, request_id: str) -> int:
        """The request's recurrent-state slot (0: none, or not a hybrid model)."""
        rp = self.req_pages.get(request_id)
        return 0 if rp is None else rp.state_slot

    def get_num_free_pages(self, group: int = GLOBAL) -> int:
        return self.pools[group].get_num_free_pages()

    @property
    def usage(self) -> float:
        """The global group's (a sliding group is sized for max_num_seqs windows)."""
        return self.pool.get_usage()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._hits)

    def reset_prefix_cache(self) -> None:
        for pool in self.pools:
            pool.reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.reset()
        if self.host is not None:
            self.host.reset()
