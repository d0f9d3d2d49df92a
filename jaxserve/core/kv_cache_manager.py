"""Per-request page tables on top of the BlockPool, with prefix-cache lookup."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.core.block_pool import BlockPool, KVCacheBlock
from jaxserve.core.request import Request
from jaxserve.core.state_slots import StateSlotPool


class _ReqPages:
    """A request's pages, their ids (kept in step to copy cheaply) and how many
    of its leading pages have been offered to the prefix cache."""

    __slots__ = ("blocks", "ids", "num_cached", "state_slot")

    def __init__(self, state_slot: int = 0) -> None:
        self.blocks: list[KVCacheBlock] = []
        self.ids: list[int] = []
        self.num_cached = 0
        self.state_slot = state_slot


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    queries: int  # tokens looked up
    hits: int  # tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Hands out fixed-size pages to requests; shares full pages by hash.

    Caching applies when `enable_caching` is on, or per request when it has a
    `cache_salt` (n>1 siblings share their prompt pages even with caching off;
    the salt keeps those pages invisible to every other request).

    Hybrid models (num_state_slots > 0: the cache plan's count, the null slot 0
    included) also give each request one recurrent-state slot (a StateSlotPool) with
    its first pages, returned with them. Their requests never share pages: a prefix
    hit would skip the tokens that build the recurrent state.
    """

    def __init__(self, num_pages: int, page_size: int, enable_caching: bool = True,
                 num_state_slots: int = 0) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if num_state_slots < 0:
            raise ValueError(f"num_state_slots must be >= 0, got {num_state_slots}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_caching = enable_caching
        self.state_slots = StateSlotPool(num_state_slots) if num_state_slots else None
        # The pool always caches; this manager decides which requests take part.
        self.pool = BlockPool(num_pages, enable_caching=True)
        self.req_pages: dict[str, _ReqPages] = {}
        self._queries = 0
        self._hits = 0

    def _shares_pages(self, request: Request) -> bool:
        """Whether the request takes part in the prefix cache (never on hybrid models)."""
        return self.state_slots is None and (self.enable_caching
                                             or request.cache_salt is not None)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole pages. At least one
        token is always left to compute, since its logits are needed."""
        if not self._shares_pages(request):
            return [], 0
        # Pages fully inside the first num_tokens - 1 tokens.
        max_pages = (request.num_tokens - 1) // self.page_size
        hashes = request.block_hashes
        cached = self.pool.cached_blocks
        hit: list[KVCacheBlock] = []
        for i in range(min(max_pages, len(hashes))):
            b = cached.get(hashes[i])
            if b is None:
                break
            hit.append(b)
        num_tokens = len(hit) * self.page_size
        self._queries += request.num_tokens
        self._hits += num_tokens
        return hit, num_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make the request's pages cover num_computed_tokens +
        num_new_computed_tokens + num_new_tokens tokens.

        Returns the newly allocated pages (possibly empty), or None, changing
        nothing, when the pool cannot supply them.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        rid = request.request_id
        rp = self.req_pages.get(rid)
        ps = self.page_size
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        caches = self._shares_pages(request)
        if rp is not None and not new_computed_blocks:
            # Fast path (most decodes): no new page and no page becomes full.
            if total <= len(rp.ids) * ps and (not caches or total // ps <= rp.num_cached):
                return []
        num_have = 0 if rp is None else len(rp.ids)
        computed = new_computed_blocks or ()
        num_new_blocks = -(-total // ps) - num_have - len(computed)
        pool = self.pool
        if num_new_blocks > 0 or computed:
            # Free-but-cached hits leave the free queue when touched.
            num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
            if num_new_blocks > pool.free_queue.num_free - num_evictable_hits:
                return None
        if rp is None:
            state_slot = 0
            if self.state_slots is not None:
                state_slot = self.state_slots.allocate()
                if state_slot is None:
                    return None
            rp = self.req_pages[rid] = _ReqPages(state_slot)
        if computed:
            if rp.blocks:
                raise ValueError(f"request {rid!r} already has pages; prefix hits only apply to new requests")
            pool.touch(computed)
            rp.blocks.extend(computed)
            rp.ids.extend(b.block_id for b in computed)
        new_blocks: list[KVCacheBlock] = []
        if num_new_blocks > 0:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            rp.blocks.extend(new_blocks)
            rp.ids.extend(b.block_id for b in new_blocks)
        # Register pages that become full with this step's tokens now, so a
        # request scheduled later in the same step can already share them.
        if caches:
            num_full = total // ps
            if num_full > rp.num_cached:
                pool.cache_full_blocks(request, rp.blocks, rp.num_cached, num_full)
                rp.num_cached = num_full
        return new_blocks

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
        blocks = rp.blocks
        first = num_written_tokens // self.page_size
        cached = self.pool.cached_blocks
        for b in blocks[first:]:
            # ref_cnt == 1: nobody else shares it (shared pages hold valid KV).
            if (b.block_hash is not None and (shared_too or b.ref_cnt == 1)
                    and cached.get(b.block_hash) is b):
                del cached[b.block_hash]
                b.block_hash = None

    def free(self, request: Request) -> None:
        """Give back all pages of the request, tail first, so that its last
        pages are evicted before its (more shareable) first ones."""
        rp = self.req_pages.pop(request.request_id, None)
        if rp is not None:
            self.pool.free_blocks(reversed(rp.blocks))
            if rp.state_slot:
                self.state_slots.free(rp.state_slot)

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's page ids, in order."""
        rp = self.req_pages.get(request_id)
        return [] if rp is None else rp.ids[:]

    def get_state_slot(self, request_id: str) -> int:
        """The request's recurrent-state slot (0: none, or not a hybrid model)."""
        rp = self.req_pages.get(request_id)
        return 0 if rp is None else rp.state_slot

    def get_num_free_pages(self) -> int:
        return self.pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.pool.get_usage()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._hits)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
