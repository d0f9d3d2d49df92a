from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.sampling_params import SamplingParams

PS = 4
EOS = 2


def sp(max_tokens=8, min_tokens=0, ignore_eos=False, stop_token_ids=None):
    return SimpleNamespace(max_tokens=max_tokens, min_tokens=min_tokens,
                           ignore_eos=ignore_eos, stop_token_ids=stop_token_ids)


def req(rid, prompt, t=0.0, priority=0, salt=None, scope=None, **kw):
    if isinstance(prompt, int):  # distinct per request, so nothing is shared by accident
        base = 100 * (ord(rid[0]) - ord("a") + 1)
        prompt = list(range(base, base + prompt))
    return Request(rid, prompt, sp(**kw), eos_token_id=EOS, arrival_time=t,
                   priority=priority, cache_salt=salt, cache_scope=scope, page_size=PS)


def sched(num_pages=65, max_num_seqs=8, budget=64, max_model_len=64, **kw):
    return Scheduler(SchedulerConfig(
        num_pages=num_pages, page_size=PS, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, max_model_len=max_model_len, **kw))


def token_for(rid, k):
    """Deterministic 'sampled' token: the k-th output of request rid (never EOS)."""
    return 1000 * (ord(rid[0]) - ord("a") + 1) + k


class Mirror:
    """What a runner rebuilds from the scheduler's diffs alone: each held request's
    tokens (prompt, then the outputs it was told were sampled) and pages."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.pages: dict[str, tuple[list[int], ...]] = {}   # per KV group
        self.num_prompt: dict[str, int] = {}

    def apply(self, out):
        """-> one view per scheduled request, in batch order, as the runner sees it."""
        for rid in out.finished_req_ids + out.preempted_req_ids:
            self.tokens.pop(rid, None)
            self.pages.pop(rid, None)
        c = out.cached_reqs
        views = []
        for rid, start, n, new_pages in zip(c.req_ids, c.num_computed_tokens,
                                            c.num_new_tokens, c.new_page_ids):
            self.pages[rid] = tuple(p + n for p, n in zip(self.pages[rid], new_pages, strict=True))
            views.append(self._view(rid, start, n))
        for r in out.new_reqs:
            assert r.req_id not in self.tokens, "a held request sent whole again"
            self.tokens[r.req_id] = list(r.prompt_token_ids) + list(r.output_token_ids)
            self.num_prompt[r.req_id] = len(r.prompt_token_ids)
            self.pages[r.req_id] = tuple(list(ids) for ids in r.page_ids)
            views.append(self._view(r.req_id, r.num_computed_tokens, r.num_new_tokens))
        return views

    def _view(self, rid, start, n):
        toks = self.tokens[rid]
        assert start + n <= len(toks), "asked to compute a token the runner cannot know"
        return SimpleNamespace(req_id=rid, start_pos=start, token_ids=toks[start:start + n],
                               page_ids=list(self.pages[rid][0]), sample=start + n == len(toks),
                               group_page_ids=tuple(list(p) for p in self.pages[rid]),
                               num_output_tokens=len(toks) - self.num_prompt[rid])

    def sampled(self, tokens: dict[str, int]):
        for rid, tok in tokens.items():
            self.tokens[rid].append(tok)


def schedule(s):
    """s.schedule(), with its diffs applied to the scheduler's mirror: (output, views)."""
    out = s.schedule()
    if not hasattr(s, "_test_mirror"):
        s._test_mirror = Mirror()
    mirror = s._test_mirror
    return out, mirror.apply(out)


def step(s, tokens=None):
    """One engine step. Returns (views of the scheduled requests, [(req_id, start_pos,
    n, sample)])."""
    out, views = schedule(s)
    assert out.num_scheduled_tokens == sum(len(r.token_ids) for r in views)
    sampled = {}
    for r in views:
        if r.sample:
            sampled[r.req_id] = (tokens or {}).get(r.req_id, token_for(r.req_id, r.num_output_tokens))
    s.update_from_output(out, sampled)
    s._test_mirror.sampled(sampled)   # the runner appends what it sampled
    return SimpleNamespace(out=out, requests=views, preempted_req_ids=out.preempted_req_ids,
                           finished_req_ids=out.finished_req_ids,
                           num_scheduled_tokens=out.num_scheduled_tokens), \
        [(r.req_id, r.start_pos, len(r.token_ids), r.sample) for r in views]


def test_chunked_prefill_token_accounting():
    s = sched(budget=8)
    a = req("a", 20, max_tokens=3)
    s.add_request(a)
    out, got = step(s)
    assert got == [("a", 0, 8, False)]
    assert out.requests[0].token_ids == list(range(100, 108))
    assert out.requests[0].page_ids == [1, 2]
    _, got = step(s)
    assert got == [("a", 8, 8, False)]
    out, got = step(s)
    assert got == [("a", 16, 4, True)]
    assert out.requests[0].num_output_tokens == 0
    assert out.requests[0].page_ids == [1, 2, 3, 4, 5]
    assert a.output_token_ids == [token_for("a", 0)]
    out, got = step(s)
    assert got == [("a", 20, 1, True)]
    assert out.requests[0].token_ids == [token_for("a", 0)]
    assert out.out.new_reqs == []  # running: a delta, no copy of its token history
    assert out.requests[0].page_ids == [1, 2, 3, 4, 5, 6]
    _, got = step(s)
    assert got == [("a", 21, 1, True)]
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert a.output_token_ids == [token_for("a", k) for k in range(3)]
    assert not s.has_unfinished_requests()
    out = s.schedule()
    assert out.req_ids == [] and out.finished_req_ids == ["a"]
    assert s.kv.get_num_free_pages() == 64


def test_output_history_is_a_copy_only_when_resumed():
    """The runner keeps each request's token history (penalties read it): a running
    request's diff carries none; one resumed after preemption brings a copy of its
    outputs so far, unaffected by later appends."""
    s = sched(num_pages=3)  # 2 usable pages
    a = Request("a", [100, 101, 102], SamplingParams(max_tokens=8, repetition_penalty=1.2),
                page_size=PS)
    b = req("b", 3, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    step(s)
    step(s)
    out, _ = step(s)  # a needs a second page: b yields
    assert out.out.new_reqs == [] and out.preempted_req_ids == ["b"]
    while s.get_request("a") is not None:
        out, _ = step(s)
    out, _ = step(s)
    new = out.out.new_reqs[0]
    before = [token_for("b", 0), token_for("b", 1)]
    assert new.req_id == "b" and new.output_token_ids == before
    hist = new.output_token_ids
    assert hist is not s.get_request("b").output_token_ids
    assert s.get_request("b").output_token_ids == before + [token_for("b", 2)]
    assert hist == before  # unaffected by the later append


def test_max_tokens_none_runs_to_max_model_len():
    s = sched(max_model_len=10)
    a = req("a", 7, max_tokens=None)
    s.add_request(a)
    for _ in range(3):
        step(s)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.num_output_tokens == 3


def test_decode_and_prefill_share_a_step():
    s = sched(budget=10)
    s.add_request(req("a", 5, max_tokens=10))
    assert step(s)[1] == [("a", 0, 5, True)]
    s.add_request(req("b", 20, max_tokens=10))
    assert step(s)[1] == [("a", 5, 1, True), ("b", 0, 9, False)]
    assert step(s)[1] == [("a", 6, 1, True), ("b", 9, 9, False)]
    assert step(s)[1] == [("a", 7, 1, True), ("b", 18, 2, True)]
    assert step(s)[1] == [("a", 8, 1, True), ("b", 20, 1, True)]


def test_max_num_seqs_cap():
    s = sched(max_num_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 3, max_tokens=2))
    assert step(s)[1] == [("a", 0, 3, True), ("b", 0, 3, True)]
    assert s.num_running == 2 and s.num_waiting == 1
    out, got = step(s)  # a and b finish here
    assert got == [("a", 3, 1, True), ("b", 3, 1, True)]
    out, got = step(s)
    assert got == [("c", 0, 3, True)]
    assert out.finished_req_ids == ["a", "b"]


def test_preemption_and_resumption_fcfs():
    s = sched(num_pages=5)  # 4 usable pages
    a = req("a", 7, max_tokens=4)
    b = req("b", list(range(30, 37)), max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    assert step(s)[1] == [("a", 0, 7, True), ("b", 0, 7, True)]
    assert s.kv.get_page_ids("a") == [1, 2] and s.kv.get_page_ids("b") == [3, 4]
    assert step(s)[1] == [("a", 7, 1, True), ("b", 7, 1, True)]
    # a needs a third page: b (last in running order) is preempted
    out, got = step(s)
    assert got == [("a", 8, 1, True)]
    assert out.preempted_req_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.kv.get_page_ids("b") == []
    assert s.kv.get_page_ids("a") == [1, 2, 4]  # b's tail page evicted first
    # b (9 tokens, 3 pages) cannot come back while a holds 3 of 4 pages
    out, got = step(s)
    assert got == [("a", 9, 1, True)] and a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # b resumes as a prefill of prompt + outputs; its first page is still cached
    out, got = step(s)
    assert got == [("b", 4, 5, True)]
    r = out.requests[0]
    assert r.token_ids == [34, 35, 36, token_for("b", 0), token_for("b", 1)]
    assert r.num_output_tokens == 2 and r.page_ids[0] == 3
    assert b.num_cached_tokens == 0  # recorded at the first schedule only
    while s.has_unfinished_requests():
        step(s)
    assert a.output_token_ids == [token_for("a", k) for k in range(4)]
    assert b.output_token_ids == [token_for("b", k) for k in range(4)]
    assert s.kv.get_num_free_pages() == 4 and s.kv_cache_usage == 0.0
    assert s.stats().num_preemptions == 1


def test_a_salted_request_keeps_its_salt_through_preemption():
    """b is preempted; it resumes from its own salted first page, which c, with the same
    tokens and another salt (or none), never gets."""
    s = sched(num_pages=5)  # 4 usable pages
    a = req("a", 7, max_tokens=4)
    b = req("b", list(range(30, 37)), max_tokens=4, salt="t1")
    s.add_request(a)
    s.add_request(b)
    step(s)
    step(s)
    out, _ = step(s)
    assert out.preempted_req_ids == ["b"] and b.status == RequestStatus.PREEMPTED
    hashes = list(b.page_hashes)
    for salt in (None, "t2"):   # b's first page is cached, but not for them
        c = req("c", list(range(30, 37)), salt=salt)
        assert s.kv.get_computed_pages(c)[1] == 0
    step(s)                     # a finishes
    out, got = step(s)
    assert got == [("b", 4, 5, True)] and out.requests[0].page_ids[0] == 3
    assert b.page_hashes[:len(hashes)] == hashes
    while s.has_unfinished_requests():
        step(s)
    c = req("c", b.all_token_ids[:9], salt="t1")   # b's two full pages, and one more
    assert s.kv.get_computed_pages(c)[1] == 8


def test_preempting_itself_fcfs():
    s = sched(num_pages=4)  # 3 usable pages
    a = req("a", 2, max_tokens=3)
    b = req("b", 7, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    assert step(s)[1] == [("a", 0, 2, True), ("b", 0, 7, True)]
    assert step(s)[1] == [("a", 2, 1, True), ("b", 7, 1, True)]
    out, got = step(s)  # b needs a third page; it is the last, so it yields itself
    assert got == [("a", 3, 1, True)] and out.preempted_req_ids == ["b"]
    assert s.num_waiting == 1 and s.num_running == 0  # a finished this step
    out, got = step(s)
    assert got == [("b", 8, 1, True)]  # both its full pages were still cached
    assert out.requests[0].page_ids == [2, 3, 1]  # its own pages, then a's
    while s.has_unfinished_requests():
        step(s)
    assert b.output_token_ids == [token_for("b", k) for k in range(3)]
    assert s.kv.get_num_free_pages() == 3


def test_no_waiting_admitted_in_a_step_with_preemption():
    s = sched(num_pages=5)
    s.add_request(req("a", 7, max_tokens=9))
    s.add_request(req("b", 7, max_tokens=9))
    step(s)
    step(s)
    s.add_request(req("c", 1, max_tokens=9))
    out, got = step(s)
    assert out.preempted_req_ids == ["b"] and [g[0] for g in got] == ["a"]


def test_priority_policy_order():
    s = sched(max_num_seqs=1, policy="priority")
    s.add_request(req("a", 2, t=0.0, priority=5, max_tokens=1))
    s.add_request(req("b", 2, t=1.0, priority=0, max_tokens=1))
    s.add_request(req("c", 2, t=2.0, priority=5, max_tokens=1))
    s.add_request(req("d", 2, t=0.5, priority=0, max_tokens=1))
    order = [step(s)[1][0][0] for _ in range(4)]
    assert order == ["d", "b", "a", "c"]


def test_priority_victim_already_scheduled_this_step():
    s = sched(num_pages=6, policy="priority")  # 5 usable pages
    a = req("a", 3, t=0.0, priority=0, max_tokens=8)
    b = req("b", [40, 41], t=1.0, priority=5, max_tokens=8)
    c = req("c", 8, t=2.0, priority=1, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    assert step(s)[1] == [("a", 0, 3, True), ("b", 0, 2, True)]
    s.add_request(c)
    assert step(s)[1] == [("a", 3, 1, True), ("b", 2, 1, True), ("c", 0, 8, True)]
    # a takes page 5 of 5; c needs one more: b (largest priority value) is the
    # victim although it was already scheduled this step, so its slot is undone
    out, got = step(s)
    assert got == [("a", 4, 1, True), ("c", 8, 1, True)]
    assert out.preempted_req_ids == ["b"] and out.num_scheduled_tokens == 2
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [token_for("b", 0), token_for("b", 1)]
    while s.has_unfinished_requests():
        step(s)
    assert b.output_token_ids == [token_for("b", k) for k in range(8)]
    assert s.kv.get_num_free_pages() == 5


def test_undone_victim_forgets_pages_it_would_have_filled():
    s = sched(num_pages=6, budget=10, policy="priority")  # 5 usable pages
    e = req("e", 5, t=0.0, priority=0, max_tokens=4)
    b = req("b", 2, t=1.0, priority=5, max_tokens=4)
    c = req("c", 16, t=2.0, priority=1, max_tokens=4)
    s.add_request(e)
    s.add_request(b)
    assert step(s)[1] == [("e", 0, 5, True), ("b", 0, 2, True)]
    s.add_request(c)
    assert step(s)[1] == [("e", 5, 1, True), ("b", 2, 1, True), ("c", 0, 8, False)]
    assert s.kv.get_page_ids("b") == [3]
    # b's decode fills its page 3 (registered at allocation); then c needs two
    # pages: b is undone and preempted, which is not enough, so c yields too.
    out, got = step(s)
    assert got == [("e", 6, 1, True)] and out.preempted_req_ids == ["b", "c"]
    assert b.num_computed_tokens == 0 and c.num_computed_tokens == 0
    # page 3 is free and will never hold b's 4th token: its hash must be gone
    pool = s.kv.pool
    assert pool.pages[3].ref_cnt == 0 and pool.pages[3].page_hash is None
    assert pool.get_cached_page(b.page_hashes[0]) is None
    # c's computed pages stay shareable
    assert [pool.get_cached_page(h).page_id for h in c.page_hashes[:2]] == [4, 5]
    while s.has_unfinished_requests():
        step(s)
    for r in (e, b, c):
        assert r.output_token_ids == [token_for(r.request_id, k) for k in range(4)]
    assert s.kv.get_num_free_pages() == 5


def test_priority_victim_is_lowest_priority_not_last():
    s = sched(num_pages=5, policy="priority")  # 4 usable pages
    s.add_request(req("a", 7, t=0.0, priority=9, max_tokens=8))
    s.add_request(req("b", 7, t=1.0, priority=0, max_tokens=8))
    assert step(s)[1] == [("b", 0, 7, True), ("a", 0, 7, True)]
    step(s)
    out, got = step(s)  # b needs a page; a is both last and lowest priority
    assert out.preempted_req_ids == ["a"] and got == [("b", 8, 1, True)]


def test_stop_eos():
    s = sched()
    a = req("a", 3, max_tokens=8)
    s.add_request(a)
    step(s, {"a": 7})
    step(s, {"a": EOS})
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason is None
    assert a.get_finish_reason() == "stop" and a.output_token_ids == [7, EOS]
    assert s.kv.get_num_free_pages() == 64 and s.num_running == 0


def test_ignore_eos_runs_to_max_tokens():
    s = sched()
    a = req("a", 3, max_tokens=3, ignore_eos=True)
    s.add_request(a)
    for _ in range(3):
        step(s, {"a": EOS})
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert a.get_finish_reason() == "length" and a.output_token_ids == [EOS] * 3


def test_stop_token_ids_and_min_tokens():
    s = sched()
    a = req("a", 3, max_tokens=8, stop_token_ids=[5, 6])
    b = req("b", 3, max_tokens=8, min_tokens=2, stop_token_ids=[5])
    s.add_request(a)
    s.add_request(b)
    step(s, {"a": 6, "b": EOS})  # b ignores eos among its first min_tokens outputs
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == 6
    assert b.status == RequestStatus.RUNNING
    step(s, {"b": 5})            # the 2nd output is still within min_tokens
    assert b.status == RequestStatus.RUNNING
    step(s, {"b": 5})
    assert b.status == RequestStatus.FINISHED_STOPPED and b.stop_reason == 5
    assert b.output_token_ids == [EOS, 5, 5]


def test_max_model_len_caps_length():
    s = sched(max_model_len=8)
    a = req("a", 6, max_tokens=100, min_tokens=50)
    s.add_request(a)
    step(s)
    step(s)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.num_tokens == 8
    with pytest.raises(ValueError):
        s.add_request(req("long", 9))


def test_abort_frees_pages():
    s = sched(max_num_seqs=1)
    a = req("a", 9, max_tokens=8)
    b = req("b", 3, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert s.kv.get_page_ids("a") == [1, 2, 3]
    s.abort_requests(["a", "b", "nope"])
    assert a.status == RequestStatus.FINISHED_ABORTED and a.get_finish_reason() == "abort"
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert s.kv.get_num_free_pages() == 64 and s.kv_cache_usage == 0.0
    assert s.num_running == 0 and s.num_waiting == 0 and not s.has_unfinished_requests()
    assert s.update_from_output(out, {"a": 7}) == [] and a.output_token_ids == []
    out = s.schedule()
    assert out.req_ids == [] and out.finished_req_ids == ["a", "b"]
    assert s.schedule().finished_req_ids == []


def test_same_step_prefix_sharing_and_scoped_siblings():
    for caching, keys, shared in ((True, {}, True), (False, {"scope": "n2"}, True),
                                  (False, {}, False), (False, {"salt": "t"}, False),
                                  (True, {"salt": "t"}, True)):
        s = sched(enable_prefix_caching=caching)
        s.add_request(req("a", list(range(9)), **keys))
        s.add_request(req("b", list(range(9)), **keys))
        out, got = step(s)
        b = out.requests[1]
        if shared:
            assert got == [("a", 0, 9, True), ("b", 8, 1, True)]
            assert b.page_ids == [1, 2, 4] and s.get_request("b").num_cached_tokens == 8
            assert s.stats().prefix_cache_hits == 8
        else:
            assert got == [("a", 0, 9, True), ("b", 0, 9, True)]
            assert b.page_ids == [4, 5, 6]


def test_pool_smaller_than_max_model_len_caps_length():
    s = sched(num_pages=3, max_model_len=64)  # 2 pages: 8 tokens fit
    a = req("a", 6, max_tokens=20)
    s.add_request(a)
    while s.has_unfinished_requests():
        step(s)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.num_tokens == 8
    assert s.stats().num_preemptions == 0


def test_add_request_validation_and_counts():
    s = sched(num_pages=3)
    s.add_request(req("a", 3))
    with pytest.raises(ValueError):
        s.add_request(req("a", 3))
    with pytest.raises(ValueError):  # needs 3 pages, the pool has 2
        s.add_request(req("big", 9))
    with pytest.raises(ValueError):
        s.add_request(Request("x", [1], sp(), page_size=8))
    with pytest.raises(ValueError):
        sched(policy="lifo")
    assert s.get_num_unfinished_requests() == 1 and s.get_request("a") is not None


def test_core_does_not_import_jax():
    root = Path(__file__).resolve().parents[2]
    code = ("import sys, jaxserve.core.scheduler, jaxserve.core.kv_cache_manager; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
    env = dict(os.environ, PYTHONPATH=str(root))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("caching", [True, False])
def test_random_workload_against_a_fake_kv_cache(policy, caching, window):
    """Random arrivals, shared prefixes, a tight pool and aborts. A fake device
    writes each scheduled token into its page slot, then checks that every
    request's pages hold exactly its tokens so far (prefix hits included).
    window: the sliding-window layers also have a (tight) pool of their own; their
    pages must hold the tokens each step's queries see (its window), and every page of
    both groups is back, unreferenced, at the end."""
    import random

    from jaxserve.core.kv_cache_manager import SLIDING

    rng = random.Random(1234)
    num_sliding = 9 if window else 0   # the least a lone request needs (3 + 3) + 2 + 1
    s = sched(num_pages=13, budget=12, max_num_seqs=4, max_model_len=40, policy=policy,
              enable_prefix_caching=caching, num_sliding_pages=num_sliding,
              sliding_window=window)
    kv_slots: dict[tuple[int, int], int] = {}
    sliding_slots: dict[tuple[int, int], int] = {}
    prefixes = [[rng.randrange(3, 50) for _ in range(9)] for _ in range(3)]
    expected: dict[str, int] = {}
    reqs: list[Request] = []
    seen_dropped = 0
    for t in range(400):
        if len(reqs) < 40 and rng.random() < 0.3:
            rid = f"r{len(reqs)}"
            tail = [rng.randrange(3, 50) for _ in range(rng.randrange(1, 12))]
            prompt = prefixes[rng.randrange(3)][: rng.randrange(0, 10)] + tail
            max_tokens = rng.randrange(1, 10)
            # A client's salt, the engine's private scope (cached with caching off too).
            keys = rng.choice([{}, {}, {}, {}, {"cache_salt": "s"}, {"cache_scope": "s"}])
            r = Request(rid, prompt, sp(max_tokens=max_tokens), eos_token_id=EOS,
                        arrival_time=float(t), priority=rng.randrange(3),
                        page_size=PS, **keys)
            s.add_request(r)
            reqs.append(r)
            expected[rid] = max_tokens
        if rng.random() < 0.02 and s.running:
            victim = rng.choice(s.running)
            s.abort_requests(victim.request_id)
            expected[victim.request_id] = -1
        out, views = schedule(s)  # what the runner sees: rebuilt from the diffs alone
        for r in views:  # "layer 0 writes K/V for the whole batch"
            for k, tok in enumerate(r.token_ids):
                pos = r.start_pos + k
                kv_slots[(r.page_ids[pos // PS], pos % PS)] = tok
                if window:
                    sliding_slots[(r.group_page_ids[SLIDING][pos // PS], pos % PS)] = tok
        for r in views:  # "then attention reads each request's context"
            req_obj = s.get_request(r.req_id)
            end = r.start_pos + len(r.token_ids)
            assert r.token_ids == req_obj.all_token_ids[r.start_pos:end]
            assert len(r.page_ids) == -(-end // PS)
            got = [kv_slots.get((r.page_ids[p // PS], p % PS)) for p in range(end)]
            assert got == req_obj.all_token_ids[:end], r.req_id
            if window:   # the keys this step's queries see, through the runner's table
                lo = max(r.start_pos - window + 1, 0)
                ids = r.group_page_ids[SLIDING]
                assert len(ids) == len(r.page_ids) and 0 not in ids[lo // PS:]
                got = [sliding_slots.get((ids[p // PS], p % PS)) for p in range(lo, end)]
                assert got == req_obj.all_token_ids[lo:end], r.req_id
        for group, usable in ((0, 12), (SLIDING, num_sliding - 1))[:2 if window else 1]:
            held = [s.kv.get_page_ids(x.request_id, group) for x in s.running]
            used = {b for ids_ in held for b in ids_} - {0}
            assert s.kv.get_num_free_pages(group) == usable - len(used)
            if group == SLIDING:
                seen_dropped += sum(ids_.count(0) for ids_ in held)
            else:
                assert 0 not in {b for ids_ in held for b in ids_}
        sampled = {r.req_id: token_for("a", r.num_output_tokens) for r in views if r.sample}
        s.update_from_output(out, sampled)
        s._test_mirror.sampled(sampled)
        if t > 300 and not s.has_unfinished_requests():
            break
    assert not s.has_unfinished_requests()
    for r in reqs:
        if expected[r.request_id] >= 0:
            assert r.output_token_ids == [token_for("a", k) for k in range(expected[r.request_id])]
    assert s.kv.get_num_free_pages() == 12 and s.kv_cache_usage == 0.0
    for pool in s.kv.pools:   # no page leaked, in either group
        assert pool.get_num_free_pages() == pool.num_pages - 1
        assert all(b.ref_cnt == 0 for b in pool.pages)
    assert s.stats().num_preemptions > 0
    if caching:
        assert s.stats().prefix_cache_hits > 0
    if window:
        assert seen_dropped > 0   # pages did leave the window
