"""The scheduler's encoder cache (core/encoder_cache.py) and the image side of a request's
page hashes: a chunk stops before an image that is not encoded and does not fit the
step's budget or the free rows; images are encoded once, when their span first enters a
chunk, and kept (least recently used evicted first) while no request holds them; the
same placeholder ids with other pixels hash to other pages."""
from __future__ import annotations

from types import SimpleNamespace

from jaxserve.core.encoder_cache import EncoderCache
from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.sampling_params import SamplingParams

PAGE = 4


def image(offset: int, length: int, h: str) -> SimpleNamespace:
    return SimpleNamespace(offset=offset, length=length, content_hash=h, processed=None)


def request(rid: str, n: int, *images) -> Request:
    mm = SimpleNamespace(images=tuple(images)) if images else None
    return Request(rid, [7] * n, SamplingParams(max_tokens=4), page_size=PAGE, multi_modal=mm)


def test_fit_cuts_before_an_image_over_the_budget_and_commit_encodes_once():
    cache = EncoderCache(num_rows=16, budget=8)
    r = request("r", 30, image(4, 6, "a"), image(12, 6, "b"))
    assert cache.fit(r, 0, 4) == 4                 # no image reached
    assert cache.fit(r, 0, 20) == 12               # a fits the budget of 8, b does not
    cache.commit(r, 0, 12)
    jobs, frees = cache.take()
    assert [j.image.content_hash for j in jobs] == ["a"] and len(jobs[0].rows) == 6 and not frees
    assert cache.fit(r, 12, 18) == 18              # a new step: b fits
    cache.commit(r, 12, 18)
    jobs, _ = cache.take()
    assert [j.image.content_hash for j in jobs] == ["b"]
    assert set(jobs[0].rows).isdisjoint(cache._entries["a"].rows)
    # A second request with image a: a hit, nothing encoded.
    s = request("s", 20, image(2, 6, "a"))
    cache.commit(s, 0, 20)
    assert cache.take() == ([], []) and cache.num_hits == 1 and cache.num_encoded == 2


def test_held_images_are_never_evicted_unused_ones_least_recent_first():
    cache = EncoderCache(num_rows=12, budget=12)
    r, s = request("r", 20, image(0, 6, "a")), request("s", 20, image(0, 6, "b"))
    for req in (r, s):
        cache.commit(req, 0, 8)
    cache.take()
    t = request("t", 20, image(0, 6, "c"))
    assert cache.fit(t, 0, 8) == 0                 # every row is held
    cache.commit(r, 8, 4)                          # r is past a: lets go of it
    cache.release(s)                               # s finished: b unused, most recent
    assert cache.fit(t, 0, 8) == 8
    cache.commit(t, 0, 8)
    jobs, frees = cache.take()
    assert frees == ["a"] and [j.image.content_hash for j in jobs] == ["c"]
    assert "b" in cache._entries                   # kept: a later request may hit it


def test_a_job_evicted_in_its_own_step_is_dropped_not_freed():
    """A request preempted in the step that encodes its image lets go of it; if another
    image takes its rows in that same step, the job goes instead of a free."""
    cache = EncoderCache(num_rows=6, budget=12)
    r, s = request("r", 20, image(0, 6, "a")), request("s", 20, image(0, 6, "b"))
    cache.commit(r, 0, 8)
    cache.release(r)
    cache.commit(s, 0, 8)
    jobs, frees = cache.take()
    assert [j.image.content_hash for j in jobs] == ["b"] and frees == []


def test_page_hashes_mix_in_the_images_they_hold():
    a, b = request("a", 12, image(5, 2, "x")), request("b", 12, image(5, 2, "y"))
    text = request("t", 12)
    assert a.page_hashes[0] == b.page_hashes[0] == text.page_hashes[0]   # before the image
    assert a.page_hashes[1] != b.page_hashes[1] and a.page_hashes[1] != text.page_hashes[1]
    assert a.page_hashes[2] != b.page_hashes[2]    # and every page after it, by the chain
    assert request("c", 12, image(5, 2, "x")).page_hashes == a.page_hashes


def test_scheduler_stops_a_chunk_before_an_image_that_waits_for_the_encoder():
    sched = Scheduler(SchedulerConfig(num_pages=64, page_size=PAGE, max_num_seqs=4,
                                      max_num_batched_tokens=20, max_model_len=64,
                                      encoder_cache_rows=10, encoder_budget=10))
    sched.add_request(request("r", 14, image(2, 10, "a")))
    sched.add_request(request("s", 24, image(2, 10, "b")))
    out = sched.schedule()
    # r whole, its image encoded; s stops before its image: the step's encoder budget
    # and every row went to r's.
    assert [(r.req_id, r.num_new_tokens) for r in out.new_reqs] == [("r", 14), ("s", 2)]
    assert [j.image.content_hash for j in out.encoder_jobs] == ["a"]
    sched.update_from_output(out, {"r": 5})
    out = sched.schedule()
    # r decodes past its image and lets go of it; s's chunk crosses its image, encoded
    # into the rows a leaves.
    assert list(out.scheduled()) == [("r", 14, 1), ("s", 2, 19)]
    assert out.encoder_frees == ["a"] and [j.image.content_hash for j in out.encoder_jobs] == ["b"]


def test_whole_images_chunks_and_hits_never_end_inside_an_image():
    """Gemma 4: image tokens see their whole image, so a chunk stops before an image it
    cannot hold whole (cached or not) and a prefix hit ends outside every image."""
    cache = EncoderCache(num_rows=64, budget=64, whole_images=True)
    r = request("r", 40, image(6, 10, "a"), image(20, 12, "b"))
    assert cache.fit(r, 0, 12) == 6            # would end inside a
    assert cache.fit(r, 0, 18) == 18           # holds a whole, stops before b
    assert cache.fit(r, 0, 25) == 20           # would end inside b
    cache.commit(r, 0, 18)
    assert cache.fit(r, 6, 8) == 0             # a cached, still not split
    sched = Scheduler(SchedulerConfig(num_pages=64, page_size=PAGE, max_num_seqs=4,
                                      max_num_batched_tokens=40, max_model_len=64,
                                      encoder_cache_rows=64, encoder_budget=40,
                                      whole_images=True))
    first = request("first", 30, image(6, 10, "a"))
    sched.add_request(first)
    out = sched.schedule()
    sched.update_from_output(out, {"first": 5})
    again = request("again", 30, image(6, 10, "a"))
    hit_pages, num_hit = sched.kv.get_computed_pages(again)
    assert num_hit == 28 and not again.splits_image(num_hit)   # 7 full pages, past a
    cut = request("cut", 14, image(6, 10, "a"))                 # 3 full pages, image to 16
    assert sched.kv.get_computed_pages(cut)[1] == 4             # 8 and 12 are inside a
