"""The KV cache manager's host tier (core/host_hits.py, core/host_cache.py), without a
device: evicted cached pages become offloads, a prefix hit runs on into the host tier and
restores into the request's first new pages, pins keep its entries through the
allocation's own evictions, the cost model keeps short prefixes computed, and a step's
copies settle (commit) or are dropped (fail) with nothing left pinned."""
from __future__ import annotations

from types import SimpleNamespace

from jaxserve.core.host_cache import HostCache
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.restore_cost import RestoreCost

PS = 4
SP = SimpleNamespace(max_tokens=1000, min_tokens=0, ignore_eos=True, stop_token_ids=None)


def make(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), SP, eos_token_id=None, arrival_time=0.0, page_size=PS)


def run(kv: KVCacheManager, req: Request) -> int:
    """A new request scheduled whole, computed and freed; -> its hit in tokens."""
    hit, num_hit = kv.get_computed_pages(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hit, num_hit) is not None
    req.num_computed_tokens = req.num_tokens
    kv.free(req)
    return num_hit


def settled(host: HostCache) -> bool:
    index = host.index
    return (all(e.pins == 0 for e in index._lru.values())
            and index.num_free + len(index) == index.num_slots - 1)


def test_evicted_pages_go_to_host_and_come_back_into_fresh_pages():
    host = HostCache(16)
    kv = KVCacheManager(5, PS, host=host)   # 4 pages of 4 tokens
    a = list(range(10, 23))                 # 13 tokens: 3 full pages
    run(kv, make("a", a))
    assert host.take_copies() is None       # nothing evicted yet
    host.commit()
    run(kv, make("b", range(100, 113)))     # takes a's pages back
    copies = host.take_copies()
    assert sorted(copies.offload_pages) == [1, 2, 3] and len(copies.offload_slots) == 3
    assert not copies.restore_slots
    host.commit()
    assert len(host.index) == 3 and settled(host)
    again = make("a2", a)
    hit, num_hit = kv.get_computed_pages(again)
    assert num_hit == 12 and hit == ([],)   # all three from the host tier
    assert kv.allocate_slots(again, 1, hit, num_hit) is not None
    copies = host.take_copies()
    pages = kv.get_page_ids("a2")
    assert copies.restore_pages == pages[:3] and len(copies.restore_slots) == 3
    # The restored pages are cached on device at once (a later request hits them there).
    assert all(kv.pool.cached_pages[h].page_id == p
               for h, p in zip(again.page_hashes, pages))
    assert all(e.pins == 1 for e in host.index._lru.values() if e.slot in copies.restore_slots)
    host.commit()
    assert settled(host)
    stats = host.stats()
    assert stats.hits == 12 and stats.pages_restored == 3 and stats.pages_offloaded >= 3


def test_a_hit_in_both_tiers_and_the_pins_hold_through_its_own_evictions():
    host = HostCache(4)                     # 3 host slots: every offload evicts one
    kv = KVCacheManager(5, PS, host=host)
    a = list(range(10, 23))
    run(kv, make("a", a))
    run(kv, make("b", range(100, 113)))
    host.take_copies()
    host.commit()                           # a's 3 pages on host, b's on device
    again = make("a2", a + [7])
    _, num_hit = kv.get_computed_pages(again)
    assert num_hit == 12
    assert kv.allocate_slots(again, 2, ([],), 12) is not None   # evicts b's pages
    copies = host.take_copies()
    # b's pages could not take a's pinned slots: the tier is full of pinned entries.
    assert len(copies.restore_slots) == 3 and not copies.offload_slots
    host.commit()
    assert settled(host)


def test_a_failed_step_drops_its_offloads_and_unpins():
    host = HostCache(16)
    kv = KVCacheManager(5, PS, host=host)
    run(kv, make("a", range(10, 23)))
    run(kv, make("b", range(100, 113)))
    assert host.take_copies().offload_slots
    host.fail()
    assert len(host.index) == 0 and settled(host)
    assert kv.get_computed_pages(make("a2", range(10, 23)))[1] == 0


def test_short_prefixes_are_recomputed_when_cheaper():
    # Restoring costs 1 ms whatever its size, a token's prefill 0.1 ms: 10 tokens break even.
    cost = RestoreCost(bytes_per_token=1, bandwidth_bytes_per_s=1e12,
                       prefill_s_per_token=1e-4, latency_s=1e-3)
    host = HostCache(16, cost=cost)
    kv = KVCacheManager(9, PS, host=host)
    short, long = list(range(10, 19)), list(range(30, 47))    # 2 and 4 full pages
    run(kv, make("s", short))
    run(kv, make("l", long))
    run(kv, make("x", range(100, 131)))                      # evicts them all
    host.take_copies()
    host.commit()
    assert kv.get_computed_pages(make("s2", short))[1] == 0   # 8 tokens: recomputed
    assert kv.get_computed_pages(make("l2", long))[1] == 16   # 16 tokens: restored
    assert kv.restore_budget(make("l2", long), 100) == cost.budget_tokens(16) > 0


def test_reset_empties_the_host_tier():
    host = HostCache(16)
    kv = KVCacheManager(5, PS, host=host)
    run(kv, make("a", range(10, 23)))
    run(kv, make("b", range(100, 113)))
    host.take_copies()
    host.commit()
    kv.reset_prefix_cache()
    assert len(host.index) == 0 and settled(host)


def test_a_failed_step_forgets_the_pages_its_restores_were_to_fill():
    """Scheduler.fail_step with a restore in flight: the restored pages' hashes go (their
    KV may never have been written), the host entries are unpinned and still there."""
    from jaxserve.core.scheduler import Scheduler, SchedulerConfig
    sched = Scheduler(SchedulerConfig(num_pages=5, page_size=PS, max_num_seqs=2,
                                      max_num_batched_tokens=64, max_model_len=16,
                                      num_host_pages=16))
    kv, host = sched.kv, sched.kv.host

    def finish(rid: str, tokens) -> None:
        sched.add_request(make(rid, tokens))
        out = sched.schedule()
        sched.update_from_output(out, {rid: 1})
        sched.finish_requests(rid, RequestStatus.FINISHED_STOPPED)

    a = list(range(10, 23))
    finish("a", a)
    finish("b", range(100, 113))            # a's pages go to host
    assert len(host.index) == 3
    sched.add_request(make("a2", a))
    out = sched.schedule()   # its pages are restored; it computes from the next step
    assert out.host_copies.restore_pages and not out.new_reqs and "a2" in sched.restoring
    sched.fail_step(out, [])
    assert not any(h in kv.pool.cached_pages for h in make("x", a).page_hashes)
    assert len(host.index) == 3 and settled(host) and not host.restored_in_flight
    # it looks up again: the host tier still has its pages
    assert not sched.restoring and sched.waiting[0].request_id == "a2"
    assert kv.get_num_free_pages() == 4
    assert sched.schedule().host_copies.restore_pages
