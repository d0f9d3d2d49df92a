"""The sliding-window layers' KV group (jaxserve/core/kv_cache_manager.py): pages that
leave a request's window go back to the pool, a prefix hit needs the window's pages,
allocation stays all-or-nothing across both groups, and nothing leaks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxserve.core.kv_cache_manager import GLOBAL, SLIDING, KVCacheManager, window_pages
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler, SchedulerConfig

PS = 4
SP = SimpleNamespace(max_tokens=1000, min_tokens=0, ignore_eos=True, stop_token_ids=None)


def make(rid: str, tokens, salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SP, eos_token_id=None, arrival_time=0.0,
                   cache_salt=salt, page_size=PS)


def manager(num_pages: int = 64, num_sliding: int = 16, window: int = 8,
            caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_pages, PS, caching, num_sliding_pages=num_sliding,
                          sliding_window=window)


def prefill(kv: KVCacheManager, req: Request, hit=None, num_hit: int = 0) -> tuple:
    """What the scheduler does for a new request scheduled in one chunk."""
    got = kv.allocate_slots(req, req.num_tokens - num_hit, hit, num_hit)
    assert got is not None
    req.num_computed_tokens = req.num_tokens
    return got


def decode(kv: KVCacheManager, req: Request, tok: int) -> tuple | None:
    req.append_output_token_ids(tok)
    got = kv.allocate_slots(req, 1)
    if got is not None:
        req.num_computed_tokens += 1
    return got


def live(kv: KVCacheManager, rid: str) -> list[int]:
    return [b for b in kv.get_page_ids(rid, SLIDING) if b]


def ids(pages) -> list[int]:
    return [b.page_id for b in pages]


def test_window_pages():
    # W positions span at most ceil((W - 1) / ps) + 1 pages.
    assert [window_pages(w, 4) for w in (1, 4, 5, 8, 9, 512)] == [1, 2, 2, 3, 3, 129]


@pytest.mark.parametrize("window", [8, 9, 13])
def test_pages_leave_the_window_during_a_long_generation(window):
    kv = manager(num_pages=200, num_sliding=16, window=window)
    a = make("a", range(5))
    prefill(kv, a)
    most = window_pages(window, PS)
    sliding = kv.sliding_pool
    while a.num_tokens < 10 * window:
        new = decode(kv, a, 7)
        assert new is not None and len(new[GLOBAL]) == len(new[SLIDING])
        nc = a.num_computed_tokens   # the step's query was at nc - 1
        first = max(nc - 1 - window + 1, 0) // PS
        held = kv.get_page_ids("a", SLIDING)
        # Before the window: the null page; from it on: live pages, as many as the
        # global group has.
        assert held[:first] == [0] * first and 0 not in held[first:]
        assert len(held) == len(kv.get_page_ids("a")) == -(-nc // PS)
        assert len(live(kv, "a")) <= most
        assert sliding.get_num_free_pages() == 15 - len(live(kv, "a"))
    assert len(kv.get_page_ids("a")) == -(-10 * window // PS)   # the global group keeps all
    # The page that left the window last went back with its hash (a prefix hit can find
    # it until it is reused); earlier ones were reused, as the pool holds 15 pages.
    page = sliding.cached_pages[a.page_hashes[first - 1]]
    assert page.ref_cnt == 0 and page.prev_free is not None and page.page_id not in held
    assert a.page_hashes[0] not in sliding.cached_pages
    kv.free(a)
    assert sliding.get_num_free_pages() == 15 and kv.get_num_free_pages() == 199
    assert all(b.ref_cnt == 0 for p in kv.pools for b in p.pages)


def test_prefix_hit_needs_the_window_pages():
    # W = 6: a query at L reads keys from L - 5 on.
    kv = manager(num_pages=40, num_sliding=10, window=6)
    a = make("a", range(21))              # 5 full pages and one partial
    prefill(kv, a)
    ga, sa = kv.get_page_ids("a"), kv.get_page_ids("a", SLIDING)
    b = make("b", list(range(20)) + [90])
    hit, n = kv.get_computed_pages(b)
    # L = 20: the window [15, 20) lies in pages 3 and 4; pages 0..2 are not needed.
    assert n == 20 and ids(hit[GLOBAL]) == ga[:5]
    assert ids(hit[SLIDING]) == [0, 0, 0] + sa[3:5]
    new = prefill(kv, b, hit, n)
    assert kv.get_page_ids("b", SLIDING) == [0, 0, 0] + sa[3:5] + ids(new[SLIDING])
    assert [kv.sliding_pool.pages[i].ref_cnt for i in sa[:5]] == [1, 1, 1, 2, 2]
    kv.free(b)
    kv.free(a)   # tail first: a's sliding pages queue as [.., a5, a4, a3, a2, a1, a0]
    # An unrelated request takes every never-used sliding page, a5 and a4: page 4 of the
    # prefix is evicted from the sliding group only (the global pool has room).
    free_sliding = kv.sliding_pool.get_num_free_pages()
    unused = free_sliding - 6
    c = make("c", range(500, 500 + PS * (unused + 2)))
    prefill(kv, c)
    assert a.page_hashes[4] not in kv.sliding_pool.cached_pages
    assert a.page_hashes[3] in kv.sliding_pool.cached_pages
    b.num_computed_tokens = 0   # as after a preemption
    hit, n = kv.get_computed_pages(b)
    # L = 20 lacks page 4's window; L = 16 reads [11, 16): pages 2 and 3, both cached.
    assert n == 16 and ids(hit[GLOBAL]) == ga[:4]
    assert ids(hit[SLIDING]) == [0, 0] + sa[2:4]
    new = prefill(kv, b, hit, n)
    assert kv.get_page_ids("b", SLIDING)[:4] == [0, 0] + sa[2:4]
    # The free-but-cached hits left the free queue; the null page took no reference.
    assert all(kv.sliding_pool.pages[i].ref_cnt == 1 for i in sa[2:4])
    assert kv.sliding_pool.null_page.ref_cnt == 0
    assert kv.prefix_cache_stats.hits == 20 + 16


def test_a_running_request_with_dropped_pages_still_serves_hits():
    kv = manager(num_pages=40, num_sliding=12, window=6)
    a = make("a", range(10))
    prefill(kv, a)
    for t in range(10, 24):   # a decodes on: its first pages leave the window
        decode(kv, a, t)
    sa = kv.get_page_ids("a", SLIDING)
    assert sa[:4] == [0, 0, 0, 0] and 0 not in sa[4:]
    b = make("b", list(range(24)) + [99])
    hit, n = kv.get_computed_pages(b)
    # L = 24 reads [19, 24): pages 4 and 5, which a holds.
    assert n == 24 and ids(hit[SLIDING]) == [0, 0, 0, 0] + sa[4:6]
    for t in range(24, 30):   # pages 4 and 5 leave a's window too: still cached
        decode(kv, a, t)
    assert kv.get_page_ids("a", SLIDING)[:6] == [0] * 6
    hit, n = kv.get_computed_pages(b)
    assert n == 24 and ids(hit[SLIDING]) == [0, 0, 0, 0] + sa[4:6]
    assert [kv.sliding_pool.pages[i].ref_cnt for i in sa[4:6]] == [0, 0]


def test_allocation_fails_atomically_when_the_sliding_pool_is_short():
    kv = manager(num_pages=40, num_sliding=5, window=6)   # 4 usable sliding pages
    a = make("a", range(12))
    prefill(kv, a)                                       # 3 sliding pages
    b = make("b", range(100, 108))                       # needs 2
    before = ([p.get_num_free_pages() for p in kv.pools], kv.get_page_ids("a"),
              kv.get_page_ids("a", SLIDING))
    assert kv.allocate_slots(b, 8) is None
    assert "b" not in kv.req_pages
    assert ([p.get_num_free_pages() for p in kv.pools], kv.get_page_ids("a"),
            kv.get_page_ids("a", SLIDING)) == before
    assert kv.allocate_slots(b, 4) is not None           # one page: fits
    # a's next page is short too, unless a page leaves its window first: at 12 computed
    # tokens its window starts at 7 (page 1), so page 0 goes back and is reused.
    assert kv.sliding_pool.get_num_free_pages() == 0
    sa = kv.get_page_ids("a", SLIDING)
    new = decode(kv, a, 12)
    assert new is not None and ids(new[SLIDING]) == sa[:1]
    assert kv.get_page_ids("a", SLIDING) == [0] + sa[1:] + sa[:1]
    assert a.page_hashes[0] not in kv.sliding_pool.cached_pages   # evicted on reuse


def test_a_shared_page_leaving_the_window_frees_nothing():
    kv = manager(num_pages=40, num_sliding=7, window=6)   # 6 usable sliding pages
    a = make("a", range(12))
    prefill(kv, a)                                       # sliding pages 1, 2, 3
    b = make("b", list(range(8)) + [50, 51, 52, 53, 54])  # shares pages 0 and 1 of a
    hit, n = kv.get_computed_pages(b)
    assert n == 8 and ids(hit[SLIDING]) == kv.get_page_ids("a", SLIDING)[:2]
    prefill(kv, b, hit, n)                               # + 2 sliding pages: 1 left
    c = make("c", range(200, 204))
    prefill(kv, c)                                       # the last one
    assert kv.sliding_pool.get_num_free_pages() == 0
    # a's page 0 leaves its window, but b still holds it: a's next page cannot come.
    before = kv.get_page_ids("a", SLIDING)
    assert decode(kv, a, 12) is None
    assert kv.get_page_ids("a", SLIDING) == before       # nothing given back either
    kv.free(c)
    assert kv.allocate_slots(a, 1) is not None
    # Giving the shared page back dropped a's reference only: b still holds it.
    assert kv.get_page_ids("a", SLIDING)[0] == 0
    shared = kv.sliding_pool.pages[before[0]]
    assert shared.ref_cnt == 1 and shared.prev_free is None


def scheduler(num_pages: int, num_sliding: int, window: int, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(
        num_pages=num_pages, page_size=PS, max_num_batched_tokens=8, max_model_len=64,
        num_sliding_pages=num_sliding, sliding_window=window, **kw))


def test_preemption_returns_both_groups_pages():
    s = scheduler(num_pages=40, num_sliding=6 + 3, window=8, max_num_seqs=4)
    reqs = [make(r, range(100 * i, 100 * i + 7)) for i, r in enumerate("abc", 1)]
    for r in reqs:
        s.add_request(r)
    preempted = []
    for _ in range(12):
        out = s.schedule()
        preempted += out.preempted_req_ids
        for rid in out.preempted_req_ids:
            assert s.kv.get_group_page_ids(rid) == ([], [])
        held = {b for r in s.running for b in s.kv.get_page_ids(r.request_id, SLIDING)} - {0}
        assert s.kv.get_num_free_pages(SLIDING) == 8 - len(held)
        s.update_from_output(out, {rid: 5 for rid, start, n in out.scheduled()
                                   if start + n == s.get_request(rid).num_tokens})
    assert preempted   # the sliding pool (8 pages for 3 windows of 3) was the tight one
    assert s.kv.get_num_free_pages() > 0
    for r in list(s.requests.values()):
        s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    for pool in s.kv.pools:
        assert pool.get_num_free_pages() == pool.num_pages - 1
        assert all(b.ref_cnt == 0 for b in pool.pages)


def test_scheduler_refuses_a_sliding_pool_one_request_cannot_fit():
    # A lone request needs its window (3 pages) and a step's 8 tokens (2): 5 + the null.
    scheduler(num_pages=40, num_sliding=6, window=8, max_num_seqs=1)
    with pytest.raises(ValueError, match="num_sliding_pages=5"):
        scheduler(num_pages=40, num_sliding=5, window=8, max_num_seqs=1)
    with pytest.raises(ValueError, match="together"):
        KVCacheManager(9, PS, num_sliding_pages=5)


class _ImagesOver4And12(Request):
    """A request whose images cover tokens 4 and 12 (strictly inside)."""

    def splits_image(self, position: int) -> bool:
        return position in (4, 12)


def test_a_hit_cut_short_by_its_window_never_ends_inside_an_image():
    """The window's cut comes after the image rule's: the shorter hit it falls back to
    must not end inside an image either (here: 12 and 4 do, and the window of 8 is gone)."""
    kv = KVCacheManager(20, PS, num_sliding_pages=5, sliding_window=5, whole_images=True)
    tokens = list(range(10, 23))                    # 3 full pages
    a = make("a", tokens)
    prefill(kv, a)
    decode(kv, a, 7)                                # sliding pages 0 and 1 leave the window
    prefill(kv, make("b", range(50, 53)))           # takes page 1's sliding page back
    kv.free(a)
    again = _ImagesOver4And12("a2", tokens, SP, eos_token_id=None, arrival_time=0.0,
                              page_size=PS)
    assert not again.splits_image(0)
    assert kv.get_computed_pages(again)[1] == 0     # not 4: inside an image
    plain = make("a3", tokens)                      # without images: all 3 pages
    assert kv.get_computed_pages(plain)[1] == 12
