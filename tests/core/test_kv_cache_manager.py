from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request, RequestStatus, hash_page_tokens

PS = 4
SP = SimpleNamespace(max_tokens=16, min_tokens=0, ignore_eos=False, stop_token_ids=None)


def make(rid, tokens, salt=None, scope=None):
    return Request(rid, list(tokens), SP, eos_token_id=None, arrival_time=0.0,
                   cache_salt=salt, cache_scope=scope, page_size=PS)


def run_prefill(kv, req, hit=(), num_hit=0):
    """What the scheduler does for a new request scheduled in one chunk."""
    req.num_computed_tokens = 0
    got = kv.allocate_slots(req, req.num_tokens - num_hit, hit or None, num_hit)
    assert got is not None
    req.num_computed_tokens = req.num_tokens
    return got[0]


def test_request_page_hashes_chain_and_extend():
    r = make("r", range(6))
    assert r.num_tokens == 6 and r.num_prompt_tokens == 6 and r.num_output_tokens == 0
    h0 = hash_page_tokens(None, (0, 1, 2, 3))
    assert r.page_hashes == [h0]
    r.append_output_token_ids(6)
    assert len(r.page_hashes) == 1
    r.append_output_token_ids([7, 8])
    assert r.page_hashes == [h0, hash_page_tokens(h0, (4, 5, 6, 7))]
    assert r.output_token_ids == [6, 7, 8] and r.all_token_ids == list(range(9))
    assert make("s", range(4), salt="x").page_hashes[0] != h0
    with pytest.raises(ValueError):
        make("e", [])


def test_salt_and_scope_key_the_first_page_and_the_chain_carries_them():
    salted = make("s", range(8), salt="x").page_hashes
    h0 = hash_page_tokens(None, (0, 1, 2, 3), ("x", None))
    assert salted == [h0, hash_page_tokens(h0, (4, 5, 6, 7))]
    assert make("s2", range(8), salt="x").page_hashes == salted
    assert make("sc", range(8), scope="r1").page_hashes[0] == hash_page_tokens(
        None, (0, 1, 2, 3), (None, "r1"))
    assert make("p", range(8)).page_hashes[0] == hash_page_tokens(None, (0, 1, 2, 3))
    # No page of a keyed request matches one keyed otherwise (or not at all), the later
    # pages included, and a salt is never mistaken for the engine's scope.
    chains = [make(str(i), range(8), salt=salt, scope=scope).page_hashes
              for i, (salt, scope) in enumerate([(None, None), ("x", None), ("y", None),
                                                 (None, "x"), ("x", "r1")])]
    for i, a in enumerate(chains):
        for b in chains[i + 1:]:
            assert all(x != y for x, y in zip(a, b, strict=True))


def test_request_status_order():
    S = RequestStatus
    assert [s for s in S if S.is_finished(s)] == [
        S.FINISHED_STOPPED, S.FINISHED_LENGTH_CAPPED, S.FINISHED_ABORTED, S.FINISHED_ERROR]
    assert S.finish_reason(S.FINISHED_STOPPED) == "stop"
    assert S.finish_reason(S.FINISHED_LENGTH_CAPPED) == "length"
    assert S.finish_reason(S.FINISHED_ABORTED) == "abort"
    assert S.finish_reason(S.FINISHED_ERROR) == "error"    # a constraint failed part-way
    assert S.finish_reason(S.RUNNING) is None


def test_allocate_and_free():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    a = make("a", range(10))
    new = run_prefill(kv, a)
    assert [b.page_id for b in new] == [1, 2, 3]
    assert kv.get_page_ids("a") == [1, 2, 3]
    assert kv.get_num_free_pages() == 5
    assert kv.usage == pytest.approx(3 / 8)
    # decode: 10 -> 11 tokens needs no new page, 12 -> 13 does
    a.append_output_token_ids(100)
    assert kv.allocate_slots(a, 1) == ([],)
    a.num_computed_tokens = 11
    a.append_output_token_ids([101, 102])
    assert [b.page_id for b in kv.allocate_slots(a, 2)[0]] == [4]
    assert kv.get_page_ids("a") == [1, 2, 3, 4]
    # the page id list handed out is a copy
    kv.get_page_ids("a").append(99)
    assert kv.get_page_ids("a") == [1, 2, 3, 4]
    kv.free(a)
    assert kv.get_num_free_pages() == 8 and kv.usage == 0.0
    assert kv.get_page_ids("a") == []


def test_prefix_hit_exact_blocks_and_refcounts():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    a = make("a", range(10))
    run_prefill(kv, a)  # pages 1,2 full and cached, 3 partial
    b = make("b", list(range(8)) + [50, 51, 52])
    hit, n = kv.get_computed_pages(b)
    assert [x.page_id for x in hit[0]] == [1, 2] and n == 8
    new = run_prefill(kv, b, hit, n)
    assert [x.page_id for x in new] == [4]
    assert kv.get_page_ids("b") == [1, 2, 4]
    pool = kv.pool
    assert [pool.pages[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    kv.free(a)
    assert [pool.pages[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    assert kv.get_num_free_pages() == 5
    assert kv.prefix_cache_stats.queries == 11 and kv.prefix_cache_stats.hits == 8


def test_full_hit_keeps_one_token_to_compute():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    run_prefill(kv, make("a", range(12)))  # three full cached pages 1,2,3
    # identical 8-token prompt: both pages hit, but the last is dropped
    hit, n = kv.get_computed_pages(make("b", range(8)))
    assert [x.page_id for x in hit[0]] == [1] and n == 4
    # 9 tokens: two full pages hit, the 9th token is computed
    hit, n = kv.get_computed_pages(make("c", range(9)))
    assert [x.page_id for x in hit[0]] == [1, 2] and n == 8
    hit, n = kv.get_computed_pages(make("d", range(12)))
    assert [x.page_id for x in hit[0]] == [1, 2] and n == 8


def test_eviction_is_lru_with_reverse_order_free():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    a = make("a", range(12))
    run_prefill(kv, a)  # 1,2,3 all full and cached
    kv.free(a)  # tail first: queue 4..8, then 3, 2, 1
    assert [b.page_id for b in kv.pool.free_queue.get_all_free_pages()] == [4, 5, 6, 7, 8, 3, 2, 1]
    c = make("c", range(100, 124))  # 6 pages, unrelated
    run_prefill(kv, c)
    assert kv.get_page_ids("c") == [4, 5, 6, 7, 8, 3]  # page 3 (a's tail) evicted
    d = make("d", list(range(12)) + [7])
    hit, n = kv.get_computed_pages(d)
    assert [x.page_id for x in hit[0]] == [1, 2] and n == 8  # chain stops at evicted page


def test_caching_off_shares_only_within_a_scope():
    kv = KVCacheManager(num_pages=17, page_size=PS, enable_caching=False)
    prompt = list(range(9))
    run_prefill(kv, make("s1", prompt, scope="r"))
    assert kv.get_computed_pages(make("plain", prompt)) == (([],), 0)
    assert kv.get_computed_pages(make("other", prompt, scope="q")) == (([],), 0)
    assert kv.get_computed_pages(make("salted", prompt, salt="r")) == (([],), 0)
    hit, n = kv.get_computed_pages(make("s2", prompt, scope="r"))
    assert [x.page_id for x in hit[0]] == [1, 2] and n == 8
    # Without a scope nothing is registered when caching is off, a client's salt
    # included: a salt only keys the hits that caching gives.
    for rid, salt in (("p1", None), ("c1", "x")):
        run_prefill(kv, make(rid, prompt, salt=salt))
        assert kv.get_computed_pages(make(rid + "'", prompt, salt=salt)) == (([],), 0)


def test_cache_salt_isolation_with_caching_on():
    kv = KVCacheManager(num_pages=17, page_size=PS)
    prompt = list(range(9))
    run_prefill(kv, make("s1", prompt, salt="x"))
    assert kv.get_computed_pages(make("plain", prompt)) == (([],), 0)
    assert kv.get_computed_pages(make("other", prompt, salt="y")) == (([],), 0)
    run_prefill(kv, make("p1", prompt))
    hit, _ = kv.get_computed_pages(make("p2", prompt))
    assert [x.page_id for x in hit[0]] == [4, 5]
    hit, _ = kv.get_computed_pages(make("s2", prompt, salt="x"))
    assert [x.page_id for x in hit[0]] == [1, 2]
    assert kv.get_computed_pages(make("other", prompt, salt="y")) == (([],), 0)
    assert kv.prefix_cache_stats.hits == 16


def test_allocate_none_changes_nothing():
    kv = KVCacheManager(num_pages=5, page_size=PS)
    run_prefill(kv, make("a", range(12)))  # 3 of 4 pages
    b = make("b", range(50, 55))  # needs 2 pages
    assert kv.allocate_slots(b, 5) is None
    assert kv.get_num_free_pages() == 1 and kv.get_page_ids("b") == []
    assert "b" not in kv.req_pages
    assert kv.allocate_slots(b, 4) is not None  # a 4-token chunk fits in one page
    assert kv.get_page_ids("b") == [4]


def test_free_cached_hits_are_not_counted_as_free():
    kv = KVCacheManager(num_pages=4, page_size=PS)
    a = make("a", range(9))
    run_prefill(kv, a)  # 1,2 cached, 3 partial
    kv.free(a)  # all 3 free; 1 and 2 still cached
    b = make("b", list(range(8)) + [60, 61, 62, 63, 64])  # 13 tokens: 4 pages
    hit, n = kv.get_computed_pages(b)
    assert [x.page_id for x in hit[0]] == [1, 2]
    # 2 new pages needed but only page 3 is free once 1,2 are touched
    assert kv.allocate_slots(b, b.num_tokens - n, hit, n) is None
    assert kv.get_num_free_pages() == 3
    assert [x.page_id for x in kv.pool.free_queue.get_all_free_pages()] == [3, 2, 1]
    assert all(kv.pool.pages[i].ref_cnt == 0 for i in (1, 2, 3))
    c = make("c", list(range(8)) + [60, 61, 62, 63])  # 12 tokens: fits
    hit, n = kv.get_computed_pages(c)
    run_prefill(kv, c, hit, n)
    assert kv.get_page_ids("c") == [1, 2, 3]
    assert kv.get_num_free_pages() == 0


def test_pages_are_shareable_within_the_same_step():
    # a chunk's pages are registered at allocation, before the step runs
    kv = KVCacheManager(num_pages=9, page_size=PS)
    a = make("a", range(9))
    kv.allocate_slots(a, 9)  # a.num_computed_tokens still 0: nothing computed yet
    hit, n = kv.get_computed_pages(make("b", range(9)))
    assert [x.page_id for x in hit[0]] == [1, 2] and n == 8


def test_uncache_unwritten_pages():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    a = make("a", range(6))
    run_prefill(kv, a)  # 1 full page cached, page 2 partial
    a.append_output_token_ids([6, 7])
    kv.allocate_slots(a, 2)  # page 2 becomes full and is registered
    assert kv.pool.get_cached_page(a.page_hashes[1]) is kv.pool.pages[2]
    kv.uncache_unwritten(a, 6)  # the step that would fill it was dropped
    assert kv.pool.get_cached_page(a.page_hashes[1]) is None
    assert kv.pool.get_cached_page(a.page_hashes[0]) is kv.pool.pages[1]


def test_reset_prefix_cache():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    run_prefill(kv, make("a", range(9)))
    kv.reset_prefix_cache()
    assert kv.get_computed_pages(make("b", range(9))) == (([],), 0)


def test_state_slots_follow_the_pages_and_hybrids_never_share():
    kv = KVCacheManager(num_pages=9, page_size=4, enable_caching=True, num_state_slots=3)
    a, b, c = make("a", list(range(8))), make("b", list(range(8))), make("c", [1, 2])
    assert kv.allocate_slots(a, 8) is not None and kv.get_state_slot("a") == 1
    # The same prompt again: no prefix hit on a hybrid model without snapshots, even
    # within a scope.
    assert kv.get_computed_pages(b) == (([],), 0)
    assert kv.get_computed_pages(make("s", list(range(8)), scope="x")) == (([],), 0)
    assert kv.allocate_slots(b, 8) is not None and kv.get_state_slot("b") == 2
    # Pages remain but no slot: nothing is allocated.
    free_pages = kv.get_num_free_pages()
    assert kv.allocate_slots(c, 2) is None
    assert kv.get_num_free_pages() == free_pages and kv.get_state_slot("c") == 0
    kv.free(a)
    assert kv.allocate_slots(c, 2) is not None and kv.get_state_slot("c") == 1
    kv.free(b)
    kv.free(c)
    assert sorted(kv.state_slots.free_slots) == [1, 2]


def test_drop_last_hit_page_leaves_out_the_hits_last_page():
    """An MTP drafter's KV at a page's last position depends on the token after the
    page, which the hash does not cover: its hits stop one page short."""
    for drop, want in ((False, 3), (True, 2)):
        kv = KVCacheManager(num_pages=9, page_size=PS, drop_last_hit_page=drop)
        run_prefill(kv, make("a", range(13)))
        hit, n = kv.get_computed_pages(make("b", list(range(12)) + [99, 98]))
        assert n == want * PS and len(hit[0]) == want, drop
    kv = KVCacheManager(num_pages=9, page_size=PS, drop_last_hit_page=True)
    run_prefill(kv, make("a", range(5)))
    assert kv.get_computed_pages(make("b", range(5)))[1] == 0   # one page: none left
