"""The KV cache manager's sliding-window group (a mixin of KVCacheManager): which pages a
prefix hit needs, and pages given back as they leave a request's window.

A sliding layer's query at position L reads keys from L - W + 1 on, so a hit of n pages
needs the sliding pages covering [n * page_size - W + 1, n * page_size) -- its last
window's -- and the null page before them. With a host tier those window pages may come
from the host's sliding index too (restored into fresh sliding pages), and the global
pages past the device's hit from its page index: so a restored prefix moves all its
global pages but only one window of sliding ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.core.host_hits import HostHit
from jaxserve.core.host_pages import HostPage, HostPageIndex
from jaxserve.core.page_pool import KVCachePage
from jaxserve.core.req_pages import SLIDING, ReqPages
from jaxserve.core.request import Request

if TYPE_CHECKING:
    from jaxserve.core.kv_cache_manager import GroupPages


class SlidingPages:
    """Needs the manager's page_size, sliding_pool, sliding_window, whole_images, host."""

    def _window_end(self, request: Request, hashes: list[int], total: int,
                    host: HostPageIndex | None) -> int:
        """The longest hit of at most `total` pages whose window's sliding pages are cached
        on device (or, host given, landed there), never ending inside an image."""
        cached = self.sliding_pool.cached_pages
        ps, w = self.page_size, self.sliding_window
        run, r = [], 0   # run[i]: consecutive available sliding pages ending at page i
        for h in hashes[:total]:
            r = r + 1 if h in cached or (host is not None and host.ready(h)) else 0
            run.append(r)
        for n in range(total, 0, -1):
            first = max(n * ps - w + 1, 0) // ps
            if n - first <= run[n - 1] and not (
                    self.whole_images and request.splits_image(n * ps)):
                return n
        return 0

    def _sliding_hit(self, request: Request, hashes: list[int], hit: list[KVCachePage],
                     extra: list[HostPage]) -> tuple[GroupPages, HostHit | None, int]:
        """The hit over both groups and both tiers: the device's global hit `hit`, then the
        host's pages `extra`, cut to the longest prefix whose window the sliding pages
        cover. -> (device pages per group: the global hit's, and the sliding list with
        the null page before the window and where a host entry fills it; the host part,
        or None; the hit the device alone gives, in pages). The host part is taken only
        when the cost model finds restoring worth it."""
        ps, host = self.page_size, None if self.host is None else self.host.sliding
        num_device = n = self._window_end(request, hashes, len(hit), None)
        if host is not None:
            n = self._window_end(request, hashes, len(hit) + len(extra), host)
            if n <= num_device or not self.host.worth_restoring((n - num_device) * ps):
                n = num_device
        cached = self.sliding_pool.cached_pages
        sliding = [self.sliding_pool.null_page] * n
        from_host: dict[int, HostPage] = {}
        for i in range(max(n * ps - self.sliding_window + 1, 0) // ps, n):
            page = cached.get(hashes[i])
            if page is not None:
                sliding[i] = page
            else:   # (n > num_device: host is not None)
                from_host[i] = host.lookup(hashes[i])
        pages = (hit[:min(n, len(hit))], sliding)
        part = extra[:max(n - len(hit), 0)]
        if not (part or from_host):
            return pages, None, num_device
        return pages, HostHit(part, from_host, (n - num_device) * ps), num_device

    def _out_of_window(self, request: Request, rp: ReqPages) -> tuple[int, int]:
        """[lo, hi): the sliding pages of the request, not yet given back, that lie wholly
        before its window (position num_computed_tokens - W + 1): no query of it reads
        them again."""
        start = request.num_computed_tokens - self.sliding_window + 1
        hi = min(max(start, 0) // self.page_size, len(rp.pages[SLIDING]))
        return rp.num_dropped, max(hi, rp.num_dropped)

    def _drop_out_of_window(self, request: Request, rp: ReqPages) -> None:
        """Gives the out-of-window sliding pages back to the pool (keeping their hashes, so
        a prefix hit may still find them until they are evicted) and puts the null page
        in their place."""
        lo, hi = self._out_of_window(request, rp)
        if hi == lo:
            return
        pages, ids = rp.pages[SLIDING], rp.ids[SLIDING]
        dropped = pages[lo:hi]
        pages[lo:hi] = [self.sliding_pool.null_page] * (hi - lo)
        ids[lo:hi] = [0] * (hi - lo)
        rp.num_dropped = hi
        self.sliding_pool.free_pages(reversed(dropped))
