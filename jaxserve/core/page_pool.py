"""Fixed-size KV pages with reference counts, an O(1) LRU free queue and a
hash -> page map for automatic prefix caching."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from jaxserve.core.request import Request


class KVCachePage:
    """One KV page. `prev_free`/`next_free` link it into the FreePageQueue."""

    __slots__ = ("page_id", "ref_cnt", "page_hash", "prev_free", "next_free")

    def __init__(self, page_id: int) -> None:
        self.page_id = page_id
        self.ref_cnt = 0
        self.page_hash: int | None = None
        self.prev_free: KVCachePage | None = None
        self.next_free: KVCachePage | None = None

    def __repr__(self) -> str:
        return f"KVCachePage(id={self.page_id}, ref={self.ref_cnt}, hash={self.page_hash})"


class FreePageQueue:
    """Doubly linked list of free pages; front = least recently freed.

    Intrusive links (stored on the pages) give O(1) removal from the middle,
    which a prefix hit on a free-but-cached page needs.
    """

    def __init__(self, pages: Iterable[KVCachePage] = ()) -> None:
        # Sentinels remove the empty-list special cases.
        self._head = KVCachePage(-1)
        self._tail = KVCachePage(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in pages:
            self.append(b)

    def popleft(self) -> KVCachePage:
        first = self._head.next_free
        if first is self._tail:
            raise ValueError("no free pages left in the free queue")
        self.remove(first)
        return first

    def append(self, page: KVCachePage) -> None:
        if page.prev_free is not None or page.next_free is not None:
            raise ValueError(f"page {page.page_id} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = page
        page.prev_free = last
        page.next_free = self._tail
        self._tail.prev_free = page
        self.num_free += 1

    def remove(self, page: KVCachePage) -> None:
        prev, nxt = page.prev_free, page.next_free
        if prev is None or nxt is None:
            raise ValueError(f"page {page.page_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        page.prev_free = page.next_free = None
        self.num_free -= 1

    def __len__(self) -> int:
        return self.num_free

    def get_all_free_pages(self) -> list[KVCachePage]:
        """Front to back; O(n), for tests and debugging."""
        out = []
        b = self._head.next_free
        while b is not self._tail:
            out.append(b)
            b = b.next_free
        return out


class PagePool:
    """All KV pages. Page 0 is the null page: padding writes go there, it is
    never handed out and never freed."""

    def __init__(self, num_pages: int, enable_caching: bool = True) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.enable_caching = enable_caching
        self.pages = [KVCachePage(i) for i in range(num_pages)]
        self.null_page = self.pages[0]
        self.free_queue = FreePageQueue(self.pages[1:])
        self.cached_pages: dict[int, KVCachePage] = {}
        # Told of each cached page get_new_pages evicts, before its hash goes (the host
        # tier copies it out: core/host_cache.py).
        self.on_evict: Callable[[KVCachePage], None] | None = None

    def get_num_free_pages(self) -> int:
        return self.free_queue.num_free

    def get_usage(self) -> float:
        """Fraction of non-null pages held by some request (ref_cnt > 0)."""
        total = self.num_pages - 1
        return 1.0 - self.free_queue.num_free / total

    def get_new_pages(self, n: int) -> list[KVCachePage]:
        """Take `n` pages from the front of the free queue (LRU first),
        evicting whatever prefix they cached."""
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot get {n} pages, only {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.page_hash is not None:
                if self.on_evict is not None and self.cached_pages.get(b.page_hash) is b:
                    self.on_evict(b)
                self.uncache(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def uncache(self, page: KVCachePage) -> None:
        """The page's hash forgotten: no look-up finds it (its KV is gone or never
        written)."""
        if self.cached_pages.get(page.page_hash) is page:
            del self.cached_pages[page.page_hash]
        page.page_hash = None

    def get_cached_page(self, page_hash: int) -> KVCachePage | None:
        if not self.enable_caching:
            return None
        return self.cached_pages.get(page_hash)

    def cache_full_pages(
        self,
        request: Request,
        pages: list[KVCachePage],
        num_cached_pages: int,
        num_full_pages: int,
    ) -> None:
        """Register hashes for pages[num_cached_pages:num_full_pages], which
        now hold full pages of request.all_token_ids."""
        if not self.enable_caching or num_full_pages <= num_cached_pages:
            return
        hashes = request.page_hashes
        if num_full_pages > len(hashes) or num_full_pages > len(pages):
            raise ValueError(
                f"num_full_pages={num_full_pages} exceeds the request's "
                f"{len(hashes)} full-page hashes or {len(pages)} pages"
            )
        cached = self.cached_pages
        null = self.null_page
        for i in range(num_cached_pages, num_full_pages):
            b = pages[i]
            # A prefix hit (already registered), or a sliding-window group's null page
            # standing in for a page before the window.
            if b.page_hash is not None or b is null:
                continue
            h = hashes[i]
            # One page per hash: an independently computed duplicate stays
            # unregistered (it is simply not shareable).
            if h not in cached:
                b.page_hash = h
                cached[h] = b

    def touch(self, pages: Iterable[KVCachePage]) -> None:
        """Take a reference on cached pages (a prefix hit); free ones leave the
        free queue so they cannot be evicted. The null page is skipped (it is never
        counted, as free_pages never frees it)."""
        fq = self.free_queue
        for b in pages:
            if b is self.null_page:
                continue
            if b.ref_cnt == 0:
                fq.remove(b)
            b.ref_cnt += 1

    def free_pages(self, ordered_pages: Iterable[KVCachePage]) -> None:
        """Drop one reference each; pages reaching 0 go to the tail of the free
        queue in the given order and keep their hash (evictable, LRU)."""
        fq = self.free_queue
        for b in ordered_pages:
            if b is self.null_page:
                continue
            if b.ref_cnt <= 0:
                raise ValueError(f"double free of page {b.page_id}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                fq.append(b)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after a weight update). Pages in use
        keep their contents but can no longer be shared."""
        for b in self.cached_pages.values():
            b.page_hash = None
        self.cached_pages.clear()
