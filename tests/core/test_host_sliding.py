"""The host tier with a sliding-window KV group (Gemma 4; core/sliding_pages.py): the
sliding pool's evictions go to the host's sliding index, a hit restored from host moves
all its global pages but only its last window's sliding ones, the window may mix device
and host pages, a hit never ends inside an image, and a step's copies settle or fail
with nothing left pinned."""
from __future__ import annotations

from types import SimpleNamespace

from jaxserve.core.host_cache import HostCache
from jaxserve.core.kv_cache_manager import GLOBAL, SLIDING, KVCacheManager
from jaxserve.core.request import Request
from tests.core.test_host_cache import run   # a request scheduled whole, computed, freed

PS, W = 4, 8   # a hit of n pages needs sliding pages n - 2 and n - 1
SP = SimpleNamespace(max_tokens=1000, min_tokens=0, ignore_eos=True, stop_token_ids=None)


def make(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), SP, eos_token_id=None, arrival_time=0.0, page_size=PS)


def manager(host: HostCache, num_pages: int = 5, num_sliding: int = 5) -> KVCacheManager:
    return KVCacheManager(num_pages, PS, num_sliding_pages=num_sliding, sliding_window=W,
                          host=host)


def settle(host: HostCache) -> None:
    host.take_copies()
    host.commit()


def settled(host: HostCache) -> bool:
    return all(all(e.pins == 0 for e in index._lru.values())
               and index.num_free + len(index) == index.num_slots - 1
               for index in (host.index, host.sliding))


A = list(range(10, 23))   # 13 tokens: 3 full pages


def test_a_restored_hit_moves_its_global_pages_and_only_its_window():
    host = HostCache(16, num_sliding_slots=16)
    kv = manager(host)
    run(kv, make("a", A))
    run(kv, make("b", range(100, 113)))   # evicts a's pages from both pools
    copies = host.take_copies()
    assert len(copies.offload_slots) == 3 and len(copies.offload_sliding_slots) == 3
    host.commit()
    again = make("a2", A)
    hit, num_hit = kv.get_computed_pages(again)
    assert num_hit == 12 and hit[GLOBAL] == [] and [b.page_id for b in hit[SLIDING]] == [0] * 3
    assert kv.allocate_slots(again, 1, hit, num_hit) is not None
    copies = host.take_copies()
    glob, sliding = kv.get_group_page_ids("a2")
    assert copies.restore_pages == glob[:3]
    assert sliding[0] == 0 and copies.restore_sliding_pages == sliding[1:3]   # the window
    assert len(copies.restore_sliding_slots) == 2
    # Restored pages are cached on device at once, in both groups.
    assert kv.sliding_pool.cached_pages[again.page_hashes[2]].page_id == sliding[2]
    host.commit()
    again.num_computed_tokens = again.num_tokens
    kv.free(again)
    assert settled(host)
    stats = host.stats()
    assert (stats.pages_restored, stats.sliding_pages_restored) == (3, 2)
    assert stats.hits == 12
    # the sliding index's own slots in use (a's pages, then b's evicted by a2's restore)
    assert (stats.sliding_num_pages, stats.sliding_capacity) == (len(host.sliding), 15) \
        and stats.sliding_num_pages >= 3
    assert stats.sliding_usage == stats.sliding_num_pages / 15


def test_the_window_mixes_device_and_host_pages():
    """The global pages stay on device, the window's sliding pages do not: only those
    come back from host."""
    host = HostCache(16, num_sliding_slots=16)
    kv = manager(host, num_pages=12)
    run(kv, make("a", A))
    run(kv, make("b", range(100, 109)))    # takes 3 of the 4 sliding pages
    settle(host)
    on_device = [h in kv.sliding_pool.cached_pages for h in make("x", A).page_hashes]
    again = make("a2", A)
    hit, num_hit = kv.get_computed_pages(again)
    assert num_hit == 12 and len(hit[GLOBAL]) == 3
    assert kv.allocate_slots(again, 1, hit, num_hit) is not None
    copies = host.take_copies()
    assert not copies.restore_slots
    assert len(copies.restore_sliding_slots) == sum(not d for d in on_device[1:3]) > 0
    host.commit()


def test_without_the_window_on_either_tier_the_hit_is_shorter():
    host = HostCache(16, num_sliding_slots=16)
    kv = manager(host, num_pages=12)
    run(kv, make("a", A))
    run(kv, make("b", range(100, 113)))
    host.take_copies()
    host.fail()                            # the sliding offloads never landed
    assert len(host.sliding) == 0
    assert kv.get_computed_pages(make("a2", A))[1] == 0
    assert settled(host)


def test_a_failed_step_forgets_the_restored_pages_in_both_groups():
    host = HostCache(16, num_sliding_slots=16)
    kv = manager(host)
    run(kv, make("a", A))
    run(kv, make("b", range(100, 113)))
    settle(host)
    again = make("a2", A)
    hit, num_hit = kv.get_computed_pages(again)
    assert kv.allocate_slots(again, 1, hit, num_hit) is not None
    host.take_copies()
    kv.fail_host_copies()
    assert not any(h in pool.cached_pages for pool in kv.pools for h in again.page_hashes)
    again.num_computed_tokens = again.num_tokens
    kv.free(again)
    assert settled(host) and len(host.sliding) == 3   # the entries stay, unpinned


def test_a_hit_over_both_tiers_never_ends_inside_an_image():
    host = HostCache(16, num_sliding_slots=16)
    kv = KVCacheManager(5, PS, num_sliding_pages=5, sliding_window=W, host=host,
                        whole_images=True)
    run(kv, make("a", A))
    run(kv, make("b", range(100, 113)))
    settle(host)
    again = _ImageOver12("a2", A, SP, eos_token_id=None, arrival_time=0.0, page_size=PS)
    assert kv.get_computed_pages(again)[1] == 8


class _ImageOver12(Request):
    def splits_image(self, position: int) -> bool:
        return position == 12
