"""Hybrid prefix caching on the host: the scheduler's snapshot restores, saves and chunk
cuts, checked against a fake device whose recurrent "state" of a slot is the list of
tokens it has consumed -- so every row must start from exactly the tokens before it."""
from __future__ import annotations

import random

import pytest

from jaxserve.core.request import RequestStatus
from jaxserve.core.state_snapshots import SnapshotCache
from tests.core.test_scheduler import PS, Mirror, req, sched, token_for

MAX_SEQS = 4


class FakeDevice:
    """Slots holding the tokens their state sums up; runs a SchedulerOutput as the
    runner does: restores, the rows, then the saves."""

    def __init__(self):
        self.slots: dict[int, list[int]] = {}
        self.slot_of: dict[str, int] = {}
        self.mirror = Mirror()

    def run(self, out):
        for rid in out.finished_req_ids + out.preempted_req_ids:
            self.slot_of.pop(rid, None)
        for src, dst in out.state_restores:
            self.slots[dst] = list(self.slots.get(src, []))
        for r in out.new_reqs:
            self.slot_of[r.req_id] = r.state_slot
        views = self.mirror.apply(out)
        for v in views:
            slot = self.slot_of[v.req_id]
            assert slot > 0
            state = [] if v.start_pos == 0 else self.slots[slot]
            # The state a row continues from is exactly its tokens before the chunk.
            assert state == self.mirror.tokens[v.req_id][:v.start_pos], v.req_id
            self.slots[slot] = state + list(v.token_ids)
        for src, dst in out.state_saves:
            self.slots[dst] = list(self.slots[src])
        return views


def run(s, dev, steps=1000):
    """Steps until nothing is left; returns each request's (start of first chunk)."""
    first_start = {}
    for _ in range(steps):
        if not s.has_unfinished_requests():
            return first_start
        out = s.schedule()
        views = dev.run(out)
        for r in out.new_reqs:
            first_start.setdefault(r.req_id, r.num_computed_tokens)
        sampled = {v.req_id: token_for(v.req_id, v.num_output_tokens) for v in views
                   if v.sample}
        s.update_from_output(out, sampled)
        dev.mirror.sampled(sampled)
    raise AssertionError("did not finish")


def hybrid(num_snapshots=8, **kw):
    kw.setdefault("max_num_seqs", MAX_SEQS)
    return sched(num_state_slots=MAX_SEQS + 1, num_snapshot_slots=num_snapshots, **kw)


def test_shared_prefix_hits_from_the_third_request_on():
    s, dev = hybrid(budget=64), FakeDevice()
    system = list(range(500, 530))          # 30 tokens: 7 full pages of 4
    starts = {}
    for i, rid in enumerate("abcd"):
        s.add_request(req(rid, system + [600 + i, 601 + i, 602 + i], max_tokens=3))
        starts.update(run(s, dev))
    # a: nothing cached; b: pages cached but no state there yet, so it keeps one at the
    # branch point (the end of the shared pages); c and d restart from it.
    assert starts["a"] == 0 and starts["b"] == 0
    assert starts["c"] == starts["d"] == 28
    assert s.kv.snapshots.num_restored_tokens == 56


def test_snapshots_are_salted_like_their_pages():
    """A snapshot is keyed by its page's hash, so a salt isolates it too: tenant t1's
    shared prefix serves only t1, and another tenant (or none) computes it afresh."""
    s, dev = hybrid(budget=64), FakeDevice()
    system = list(range(500, 530))
    starts = {}
    for i, (rid, salt) in enumerate([("a", "t1"), ("b", "t1"), ("c", "t1"), ("d", None),
                                     ("e", "t2"), ("f", "t1")]):
        s.add_request(req(rid, system + [600 + i, 601 + i], max_tokens=2, salt=salt))
        starts.update(run(s, dev))
    assert starts == {"a": 0, "b": 0, "c": 28, "d": 0, "e": 0, "f": 28}


def test_next_turn_of_a_chat_reuses_the_previous_turn():
    s, dev = hybrid(budget=64), FakeDevice()
    turn1 = req("t1", list(range(700, 722)), max_tokens=9)   # 22 prompt + 9 output
    s.add_request(turn1)
    run(s, dev)
    history = turn1.all_token_ids                              # 31 tokens
    s.add_request(req("t2", history + [800, 801, 802], max_tokens=2))
    starts = run(s, dev)
    # The rolling snapshot sits at the last page boundary turn 1 computed: 30 - 30 % 4 = 28
    # (its last sampled token was never computed).
    assert starts["t2"] == (len(history) - 1) // PS * PS == 28


def test_thinking_turn_restarts_at_the_end_of_the_prompt():
    """A next turn that drops the previous answer (a thinking model's template) shares
    only the prompt: the kept snapshot at the prompt's last full page serves it."""
    s, dev = hybrid(budget=64), FakeDevice()
    prompt = list(range(700, 722))                             # 22 tokens: 5 pages
    s.add_request(req("t1", prompt, max_tokens=12))
    run(s, dev)
    s.add_request(req("t2", prompt + [900, 901], max_tokens=2))
    assert run(s, dev)["t2"] == 20


def test_chunks_stop_at_the_prompts_last_full_page():
    s, dev = hybrid(budget=64), FakeDevice()
    s.add_request(req("a", 22, max_tokens=1))
    out = s.schedule()
    dev.run(out)
    assert out.new_reqs[0].num_new_tokens == 20    # cut at 5 full pages
    assert out.state_saves                          # a snapshot is taken there
    s.update_from_output(out, {})


def test_random_workload_never_corrupts_a_state_and_leaks_nothing():
    rnd = random.Random(0)
    s, dev = hybrid(num_snapshots=5, budget=16, num_pages=40, max_model_len=64), FakeDevice()
    prefixes = [[1000 + 50 * k + j for j in range(rnd.randrange(3, 30))] for k in range(4)]
    n = 0
    for _ in range(40):
        for _ in range(rnd.randrange(0, 3)):
            base = rnd.choice(prefixes)
            tail = [rnd.randrange(2000, 3000) for _ in range(rnd.randrange(1, 12))]
            s.add_request(req(f"{chr(97 + n % 26)}{n}", base + tail,
                              max_tokens=rnd.randrange(1, 10)))
            n += 1
        if s.has_unfinished_requests():
            out = s.schedule()
            views = dev.run(out)
            if rnd.random() < 0.1 and s.running:
                s.abort_requests(rnd.choice(s.running).request_id)
            sampled = {v.req_id: token_for(v.req_id, v.num_output_tokens) for v in views
                       if v.sample and s.get_request(v.req_id) is not None}
            s.update_from_output(out, sampled)
            dev.mirror.sampled(sampled)
    run(s, dev)
    snaps = s.kv.snapshots
    assert snaps.num_free + snaps.num_cached == snaps.num_slots   # every slot accounted
    assert s.kv.get_num_free_pages() == 39
    assert sorted(s.kv.state_slots.free_slots) == list(range(1, MAX_SEQS + 1))
    assert snaps.num_restored_tokens > 0


def test_preempted_request_resumes_from_its_own_snapshot():
    s, dev = hybrid(budget=64, num_pages=13, max_model_len=48), FakeDevice()
    a, b = req("a", 20, max_tokens=20), req("b", 20, max_tokens=20)
    s.add_request(a)
    s.add_request(b)
    starts = []
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        views = dev.run(out)
        starts += [(r.req_id, r.num_computed_tokens) for r in out.new_reqs]
        sampled = {v.req_id: token_for(v.req_id, v.num_output_tokens) for v in views if v.sample}
        s.update_from_output(out, sampled)
        dev.mirror.sampled(sampled)
    assert s.num_preemptions > 0
    # (The fake device checked every resumed state.) Pages a resumed request still
    # finds cached come with its own snapshot; those reused meanwhile are computed again.
    resumed = starts[2:]
    assert any(start > 0 for _, start in resumed), starts
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_a_failed_step_forgets_its_snapshots():
    s = hybrid(budget=64)
    s.add_request(req("a", 22, max_tokens=1))
    out = s.schedule()
    assert out.state_saves
    s.fail_step(out, ["a"])
    assert s.kv.snapshots.num_cached == 0
    assert s.kv.snapshots.num_free == s.kv.snapshots.num_slots


def test_eviction_keeps_the_long_shared_prefix():
    c = SnapshotCache(first_slot=5, num_slots=2)
    assert c.save_branch(1, page_hash=11, num_tokens=400)
    assert c.save_branch(2, page_hash=22, num_tokens=16)
    c.commit()
    assert c.num_free == 0
    assert c.save_branch(3, page_hash=33, num_tokens=64)   # evicts the 16-token one
    c.commit()
    assert c.lookup(11, 400) is not None and c.lookup(22, 16) is None
    assert c.lookup(33, 64) is not None


def test_snapshot_cache_refuses_bad_slots():
    with pytest.raises(ValueError):
        SnapshotCache(first_slot=0, num_slots=2)


def test_eviction_keeps_a_shared_prefix_over_longer_unused_ones():
    c = SnapshotCache(first_slot=5, num_slots=2)
    c.save_branch(1, page_hash=11, num_tokens=32)    # a shared system prompt
    c.save_branch(2, page_hash=22, num_tokens=48)    # one request's own prompt
    c.commit()
    c.use(c.lookup(11, 32))
    c.use(c.lookup(11, 32))
    c.save_branch(3, page_hash=33, num_tokens=64)
    c.commit()
    assert c.lookup(11, 32) is not None and c.lookup(22, 48) is None
