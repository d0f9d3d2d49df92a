"""The scheduler's side of speculative decoding, model-free: a real Scheduler with the
runner's answers written by hand (a row that verified drafts answers with a list: the
drafts accepted, then the token sampled after them; an int there is refused). Drafts go
only to rows that compute their last known token alone (not a prefill chunk, nor a
hybrid's row computing tokens again after a rollback), capped by max_model_len,
max_tokens and the budget the running rows after them do not need for a token each; a
partial acceptance leaves num_computed_tokens = num_tokens - 1; a stop inside the
accepted run truncates; hybrids hold a backup state slot, restore it after a rejection
and count the tokens computed again (in a step without drafts: a rejection never rolls
a request back past the step before it); a row whose pages do not fit first drops its
drafts and its lookahead pages, and only then preempts (dropping the victim's drafts
and pending copies); lookahead pages follow a chunk that reaches the last known token;
the prefix cache never registers a page holding draft positions; the spec counters add
up."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxserve.core.request import Request, RequestStatus, hash_page_tokens
from jaxserve.core.scheduler import Scheduler, SchedulerConfig

PS = 4
EOS = 2


def sp(max_tokens=32, min_tokens=0, ignore_eos=False, stop_token_ids=None):
    return SimpleNamespace(max_tokens=max_tokens, min_tokens=min_tokens,
                           ignore_eos=ignore_eos, stop_token_ids=stop_token_ids)


def req(rid, prompt, t=0.0, priority=0, **kw):
    if isinstance(prompt, int):   # distinct per request
        base = 100 * (ord(rid[0]) - ord("a") + 1)
        prompt = list(range(base, base + prompt))
    return Request(rid, prompt, sp(**kw), eos_token_id=EOS, arrival_time=t,
                   priority=priority, page_size=PS)


def sched(num_pages=65, max_num_seqs=4, budget=64, max_model_len=64, k=3, **kw):
    """num_pages includes the null page: num_pages - 1 usable."""
    return Scheduler(SchedulerConfig(
        num_pages=num_pages, page_size=PS, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, max_model_len=max_model_len, num_speculative_tokens=k,
        **kw))


def cols(out):
    """{req_id: (start, num_new)} of every scheduled request."""
    return {rid: (start, n) for rid, start, n in out.scheduled()}


def start(s, *reqs, first=None, proposals=None):
    """Adds the requests, runs their prefill step (its sampled tokens: `first`, default
    50 + i) and hands the proposals. -> that step's output."""
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert out.spec_token_ids == {}          # new requests never verify drafts
    first = first or {r.request_id: 50 + i for i, r in enumerate(reqs)}
    s.update_from_output(out, first, proposals or {})
    return out


# ---- which rows verify drafts, and how many ------------------------------------------

def test_drafts_follow_the_last_known_token():
    s = sched()
    a = req("a", 6)
    start(s, a, proposals={"a": [51, 52, 53]})
    assert a.spec_token_ids == [51, 52, 53] and a.num_computed_tokens == 6
    out = s.schedule()
    # The last known token (position 6) and its 3 drafts: 1 + k tokens.
    assert cols(out) == {"a": (6, 4)} and out.num_scheduled_tokens == 4
    assert out.spec_token_ids == {"a": [51, 52, 53]}
    assert a.num_computed_tokens == 10 and a.num_tokens == 7
    # Its pages cover the drafts' positions too (0..9: 3 pages).
    assert len(s.kv.get_page_ids("a")) == 3
    assert out.cached_reqs.new_page_ids[0] == ([3],)


def test_rows_short_of_their_last_token_get_no_drafts():
    # Only a row that computes its last known token alone verifies drafts: no prefill
    # chunk does, short of the end or reaching it, even with drafts pending; the step
    # after the prompt's last chunk takes them (within the budget).
    s = sched(budget=4)
    a = req("a", 10)
    s.add_request(a)
    out = s.schedule()
    assert cols(out) == {"a": (0, 4)}
    a.spec_token_ids = [7, 8, 9]   # (white-box: drafts pending while a prefills)
    s.update_from_output(out, {}, {})
    out = s.schedule()
    assert cols(out) == {"a": (4, 4)} and out.spec_token_ids == {}
    s.update_from_output(out, {}, {})
    out = s.schedule()
    # The last 2 prompt tokens, no drafts (though the budget has room for 2 of them).
    assert cols(out) == {"a": (8, 2)} and out.spec_token_ids == {}
    assert a.spec_token_ids == [7, 8, 9]   # still pending
    s.update_from_output(out, {"a": 50}, {"a": [51, 52, 53]})
    out = s.schedule()
    # Its last known token alone, and 3 drafts (budget 4).
    assert cols(out) == {"a": (10, 4)} and out.spec_token_ids == {"a": [51, 52, 53]}
    # Exactly the budget to the end: no room for a draft.
    s2 = sched(budget=2)
    b = req("b", 2)
    s2.add_request(b)
    b.spec_token_ids = [7]
    out = s2.schedule()
    assert [r.num_new_tokens for r in out.new_reqs] == [2] and out.spec_token_ids == {}


def test_num_new_is_one_plus_k_per_decoding_row():
    s = sched(k=4)
    a, b, c = req("a", 5), req("b", 3), req("c", 7)
    start(s, a, b, c, proposals={"a": [1, 1, 1, 1], "b": [3, 4], "c": []})
    out = s.schedule()
    assert cols(out) == {"a": (5, 5), "b": (3, 3), "c": (7, 1)}
    assert out.spec_token_ids == {"a": [1, 1, 1, 1], "b": [3, 4]}
    assert out.num_scheduled_tokens == 9


def test_budget_caps_the_drafts():
    # The last running row's drafts take whatever budget is left.
    s = sched(budget=7, k=3)
    a, b = req("a", 3), req("b", 2)
    start(s, a, b, proposals={"a": [1, 1, 1], "b": [3, 3, 3]})
    out = s.schedule()
    # a takes 1 + 3 (one token kept back for b); b the 3 left: 1 + 2 drafts.
    assert cols(out) == {"a": (3, 4), "b": (2, 3)}
    assert out.spec_token_ids == {"a": [1, 1, 1], "b": [3, 3]}
    assert out.num_scheduled_tokens == 7
    # b's third draft is not verified; its answer may accept only the two sent.
    s.update_from_output(out, {"a": [1, 1, 1, 9], "b": [3, 3, 8]}, {})
    assert b.output_token_ids == [51, 3, 3, 8] and b.num_computed_tokens == b.num_tokens - 1
    s = sched(budget=7, k=3)
    a, b = req("a", 3), req("b", 2)
    start(s, a, b, proposals={"a": [1, 1, 1], "b": [3, 3, 3]})
    out = s.schedule()
    with pytest.raises(ValueError, match="accepted"):
        s.update_from_output(out, {"a": [1, 1, 1, 9], "b": [3, 3, 3, 8]}, {})


def test_drafts_leave_a_token_for_each_running_row_after_them():
    # Drafts only take the budget the rows after them do not need for one token each:
    # a row that comes later is never starved by the drafts of those before it.
    s = sched(budget=7, k=3)
    a, b, c = req("a", 3), req("b", 2), req("c", 2)
    start(s, a, b, c, proposals={"a": [1, 1, 1], "b": [3, 3, 3], "c": [4, 4, 4]})
    out = s.schedule()
    # a: 7 - 1 - 2 rows after = 4 spare, 3 drafts; b: 3 - 1 - 1 = 1 draft; c: 1 - 1 = 0.
    assert cols(out) == {"a": (3, 4), "b": (2, 2), "c": (2, 1)}
    assert out.spec_token_ids == {"a": [1, 1, 1], "b": [3]}
    assert out.num_scheduled_tokens == 7
    s.update_from_output(out, {"a": [1, 1, 1, 9], "b": [3, 8], "c": 7},
                         {"a": [5], "b": [6], "c": [7, 7, 7]})
    assert b.output_token_ids == [51, 3, 8] and b.num_computed_tokens == b.num_tokens - 1
    assert c.output_token_ids == [52, 7] and c.num_computed_tokens == c.num_tokens - 1
    # Fewer drafts before it: c's take the rest. a: 1 + 1, b: 1 + 1, c: 1 + 2 (7 - 4 - 1).
    out = s.schedule()
    assert cols(out) == {"a": (7, 2), "b": (4, 2), "c": (3, 3)}
    assert out.spec_token_ids == {"a": [5], "b": [6], "c": [7, 7]}


@pytest.mark.parametrize("budget,want", [
    (16, [4, 4, 4, 4]), (10, [4, 4, 1, 1]), (7, [4, 1, 1, 1]), (5, [2, 1, 1, 1]),
    (4, [1, 1, 1, 1]), (3, [1, 1, 1])])   # 3: fewer tokens than rows, d waits
def test_four_drafting_rows_each_get_a_token(budget, want):
    s = sched(max_num_seqs=4, budget=16, k=3)
    rs = [req(r, 2) for r in "abcd"]
    start(s, *rs, proposals={r: [7, 7, 7] for r in "abcd"})
    s.max_num_batched_tokens = budget   # (white-box: the prefill step had more)
    out = s.schedule()
    assert [n for _, _, n in out.scheduled()] == want
    assert out.num_scheduled_tokens == sum(want) == min(budget, 16)
    assert out.spec_token_ids == {r: [7] * (n - 1) for r, n in zip("abcd", want) if n > 1}


@pytest.mark.parametrize("budget,want", [(16, [4, 4, 4, 4]), (10, [4, 4, 1, 1]),
                                         (6, [3, 1, 1, 1])])
def test_no_running_row_starves_while_the_others_draft(budget, want):
    # Every step all 4 rows propose 3 drafts; whatever they accept, each row gets at
    # least its one token every step (before, with a budget of 10 d got none: a and b
    # took 4 each and c the 2 left).
    s = Scheduler(SchedulerConfig(
        num_pages=65, page_size=PS, max_num_seqs=4, max_num_batched_tokens=budget,
        max_model_len=64, num_speculative_tokens=3))
    rs = [req(r, 1) for r in "abcd"]
    drafts = [70, 71, 72]
    start(s, *rs, proposals={r: drafts for r in "abcd"})
    for step in range(6):
        before = [r.num_output_tokens for r in rs]
        out = s.schedule()
        assert [rid for rid, _, _ in out.scheduled()] == list("abcd")
        assert [n for _, _, n in out.scheduled()] == want
        assert out.num_scheduled_tokens == sum(want) <= budget
        # Row j accepts (step + j) % 4 of its drafts (all it got, at most).
        answer = {}
        for j, (rid, _, n) in enumerate(out.scheduled()):
            acc = min((step + j) % 4, n - 1)
            answer[rid] = drafts[:acc] + [80 + step] if n > 1 else 80 + step
        s.update_from_output(out, answer, {r: drafts for r in "abcd"})
        for r, b in zip(rs, before):
            assert r.num_output_tokens > b and r.num_computed_tokens == r.num_tokens - 1


def test_max_model_len_caps_the_drafts():
    s = sched(max_model_len=12)
    a = req("a", 8, max_tokens=None)
    start(s, a, proposals={"a": [11, 12, 13]})
    out = s.schedule()
    # 9 tokens known: 2 drafts and the token after them reach the limit of 12.
    assert out.spec_token_ids == {"a": [11, 12]} and cols(out) == {"a": (8, 3)}
    s.update_from_output(out, {"a": [11, 12, 7]}, {"a": [5, 5, 5]})
    assert a.num_tokens == 12 and a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # One token short of the limit: no draft at all.
    s = sched(max_model_len=12)
    b = req("b", 10, max_tokens=None)
    start(s, b, proposals={"b": [11, 12, 13]})
    out = s.schedule()
    assert out.spec_token_ids == {} and cols(out) == {"b": (10, 1)}


def test_max_tokens_caps_the_drafts():
    s = sched()
    a = req("a", 4, max_tokens=4)
    start(s, a, proposals={"a": [51, 52, 53]})
    out = s.schedule()
    # 1 output so far: 2 drafts and the token after them make the 4.
    assert out.spec_token_ids == {"a": [51, 52]} and cols(out) == {"a": (4, 3)}
    done = s.update_from_output(out, {"a": [51, 52, 54]}, {"a": [9]})
    assert done == [a] and a.output_token_ids == [50, 51, 52, 54]
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.kv.get_num_free_pages() == 64
    # A single token left: no draft.
    s = sched()
    b = req("b", 4, max_tokens=2)
    start(s, b, proposals={"b": [51, 52, 53]})
    out = s.schedule()
    assert out.spec_token_ids == {} and cols(out) == {"b": (4, 1)}


# ---- the runner's answer ---------------------------------------------------------------

@pytest.mark.parametrize("answer,accepted", [
    ([60], 0), ([51, 60], 1), ([51, 52, 60], 2), ([51, 52, 53, 60], 3)])
def test_partial_acceptance(answer, accepted):
    s = sched()
    a = req("a", 6)
    start(s, a, proposals={"a": [51, 52, 53]})
    out = s.schedule()
    got = s.update_from_output(out, {"a": answer}, {"a": [70, 71]})
    assert got == [a]
    assert a.output_token_ids == [50] + answer
    assert a.all_token_ids == list(range(100, 106)) + [50] + answer
    # The rejected drafts' positions count as not computed: only the last token is left.
    assert a.num_computed_tokens == a.num_tokens - 1 == 6 + accepted + 1
    assert a.spec_token_ids == [70, 71]
    out = s.schedule()
    assert cols(out) == {"a": (a.num_tokens - 1, 3)} and out.spec_token_ids == {"a": [70, 71]}


def test_rejected_draft_positions_keep_their_pages():
    # The pages allocated for drafts stay with the request (written over later).
    s = sched()
    a = req("a", 4)
    start(s, a, proposals={"a": [1, 1, 1]})
    out = s.schedule()   # positions 4..7: page 2
    assert s.kv.get_page_ids("a") == [1, 2]
    s.update_from_output(out, {"a": [9]}, {"a": [1, 1, 1]})
    out = s.schedule()   # positions 5..8: page 3
    assert cols(out) == {"a": (5, 4)} and s.kv.get_page_ids("a") == [1, 2, 3]


def test_stop_inside_the_accepted_run_truncates():
    s = sched()
    a = req("a", 6)
    b = req("b", 6, stop_token_ids=[77])
    start(s, a, b, proposals={"a": [51, EOS, 53], "b": [61, 77, 63]})
    out = s.schedule()
    done = s.update_from_output(out, {"a": [51, EOS, 53, 54], "b": [61, 77, 63, 64]},
                                {"a": [1], "b": [1]})
    assert done == [a, b]
    assert a.output_token_ids == [50, 51, EOS] and a.status == RequestStatus.FINISHED_STOPPED
    assert b.output_token_ids == [51, 61, 77] and b.stop_reason == 77
    assert b.all_token_ids[-1] == 77
    assert s.running == [] and s.kv.get_num_free_pages() == 64
    assert s.num_generation_tokens == 2 + 2 + 2   # prefill tokens, then 2 kept each
    out = s.schedule()
    assert sorted(out.finished_req_ids) == ["a", "b"] and out.num_scheduled_tokens == 0


def test_min_tokens_hold_a_stop_in_the_accepted_run():
    s = sched()
    a = req("a", 6, min_tokens=3)
    start(s, a, proposals={"a": [EOS, 52, 53]})
    out = s.schedule()
    # EOS is the 2nd output: within min_tokens = 3, so it does not stop the request.
    s.update_from_output(out, {"a": [EOS, 52, 53, 54]}, {})
    assert a.output_token_ids == [50, EOS, 52, 53, 54] and not a.is_finished()


def test_answer_that_is_not_the_drafts_is_refused():
    for answer in ([51, 99, 60],          # "accepted" 99 for draft 52
                   [52, 60],              # first token differs from the first draft
                   [51, 52, 53, 54, 55]):  # more accepted than drafted
        s = sched()
        a = req("a", 6)
        start(s, a, proposals={"a": [51, 52, 53]})
        out = s.schedule()
        with pytest.raises(ValueError, match="accepted"):
            s.update_from_output(out, {"a": answer}, {})
    # A list for a row that verified no drafts may hold only the token after them.
    s = sched()
    a = req("a", 6)
    start(s, a)
    out = s.schedule()
    assert out.spec_token_ids == {}
    with pytest.raises(ValueError, match="accepted"):
        s.update_from_output(out, {"a": [5, 6]}, {})


def test_an_int_answer_for_a_row_that_verified_drafts_is_refused():
    # Even a rejection of every draft comes as a list ([token]), never as a bare int.
    s = sched()
    a = req("a", 6)
    start(s, a, proposals={"a": [51, 52, 53]})
    out = s.schedule()
    assert out.spec_token_ids == {"a": [51, 52, 53]}
    with pytest.raises(ValueError, match="verified drafts.*list"):
        s.update_from_output(out, {"a": 60}, {})
    assert a.output_token_ids == [50] and a.num_computed_tokens == 10
    assert s.spec_num_drafts == 0 and s.num_generation_tokens == 1
    s.update_from_output(out, {"a": [60]}, {})   # the list is taken
    assert a.output_token_ids == [50, 60] and a.num_computed_tokens == 7


def test_a_plain_token_for_a_row_without_drafts_and_proposals_replace_drafts():
    s = sched()
    a = req("a", 6)
    start(s, a, proposals={"a": [51, 52, 53]})
    out = s.schedule()
    s.update_from_output(out, {"a": [51, 60]}, {})   # no new proposal: no drafts
    assert a.spec_token_ids == []
    out = s.schedule()
    assert out.spec_token_ids == {} and cols(out) == {"a": (8, 1)}
    s.update_from_output(out, {"a": 61}, {"a": [4, 4]})
    assert a.output_token_ids == [50, 51, 60, 61] and a.spec_token_ids == [4, 4]


# ---- hybrids: a backup state slot ---------------------------------------------------------

def hybrid(**kw):
    kw.setdefault("max_num_seqs", 4)
    return sched(num_state_slots=2 * kw["max_num_seqs"] + 1, **kw)


def slots(s, rid):
    rp = s.kv.req_pages[rid]
    return rp.state_slot, rp.backup_slot


def test_hybrid_needs_two_slots_per_request():
    with pytest.raises(ValueError, match="2 state slot"):
        sched(num_state_slots=8, max_num_seqs=4)
    sched(num_state_slots=5, max_num_seqs=4, k=0)   # one each without speculation


def test_hybrid_backup_and_rollback_pairs():
    s = hybrid()
    a, b = req("a", 6), req("b", 5)
    out = start(s, a, b, proposals={"a": [51, 52, 53], "b": [61]})
    assert out.state_restores == []
    sa, ba = slots(s, "a")
    sb, bb = slots(s, "b")
    assert len({sa, ba, sb, bb}) == 4 and 0 not in (sa, ba, sb, bb)
    assert [r.state_slot for r in out.new_reqs] == [sa, sb]
    assert s.kv.state_slots.num_free == 8 - 4
    # A step with drafts keeps each verifying row's state in its backup first.
    out = s.schedule()
    assert out.state_restores == [(sa, ba), (sb, bb)]
    assert cols(out) == {"a": (6, 4), "b": (5, 2)}
    # a rejects 2 of 3: its state goes back to the backup and it restarts at the step's
    # start (the accepted token is computed again); b accepts all: nothing to undo.
    s.update_from_output(out, {"a": [51, 60], "b": [61, 62]}, {"a": [70, 71], "b": [72]})
    assert a.num_computed_tokens == 6 and a.num_tokens == 9
    assert s.spec_num_recomputed_tokens == 2   # a's 50 and 51 (positions 6, 7)
    assert b.num_computed_tokens == b.num_tokens - 1 == 7
    assert a.spec_token_ids == [70, 71]
    out = s.schedule()
    # a's rollback; a computes its 3 known tokens again without its drafts (so no
    # backup of it): only b keeps its state first.
    assert out.state_restores == [(ba, sa), (sb, bb)]
    assert cols(out) == {"a": (6, 3), "b": (7, 2)}
    assert out.spec_token_ids == {"b": [72]}
    # a verified nothing: a plain token. b rejects its draft: its rollback is pending.
    s.update_from_output(out, {"a": 80, "b": [81]}, {"a": [82, 83], "b": [84]})
    assert a.num_computed_tokens == a.num_tokens - 1 == 9
    assert s.spec_num_recomputed_tokens == 2 + 1   # b rejected its draft: its 62 again
    assert b.num_computed_tokens == 7 and b.num_tokens == 9
    out = s.schedule()
    # The rollback comes before this step's backups; a drafts again, b does not.
    assert out.state_restores == [(bb, sb), (sa, ba)]
    assert cols(out) == {"a": (9, 3), "b": (7, 2)}
    assert out.spec_token_ids == {"a": [82, 83]}
    # All accepted now: no rollback; no drafts next: no backup.
    s.update_from_output(out, {"a": [82, 83, 85], "b": 86}, {})
    assert a.num_computed_tokens == a.num_tokens - 1 == 12
    assert b.num_computed_tokens == b.num_tokens - 1 == 9
    assert s.spec_num_recomputed_tokens == 2 + 1
    out = s.schedule()
    assert out.state_restores == [] and out.spec_token_ids == {}
    assert cols(out) == {"a": (12, 1), "b": (9, 1)}


@pytest.mark.parametrize("answer,recomputed", [
    ([60], 1), ([51, 60], 2), ([51, 52, 60], 3), ([51, 52, 53, 60], 0)])
def test_hybrid_counts_the_recomputed_tokens(answer, recomputed):
    # After a rejection the state goes back to the step's start (6): every token known
    # after the step but the one sampled last is computed again.
    s = hybrid()
    a = req("a", 6)
    start(s, a, proposals={"a": [51, 52, 53]})
    sa, ba = slots(s, "a")
    out = s.schedule()
    assert cols(out) == {"a": (6, 4)}
    s.update_from_output(out, {"a": answer}, {"a": [70, 71, 72]})
    assert s.spec_num_recomputed_tokens == recomputed
    assert a.num_tokens - 1 - a.num_computed_tokens == recomputed
    out = s.schedule()
    if recomputed:
        # They and the token sampled last, from the backup, without the new drafts.
        assert cols(out) == {"a": (6, recomputed + 1)} and out.spec_token_ids == {}
        assert out.state_restores == [(ba, sa)]
        s.update_from_output(out, {"a": 80}, {"a": [81, 82, 83]})
        assert a.num_computed_tokens == a.num_tokens - 1 == 6 + recomputed + 1
        assert s.spec_num_recomputed_tokens == recomputed   # nothing more
        out = s.schedule()
        # Its last known token alone: it drafts again, its state kept first.
        assert cols(out) == {"a": (a.num_tokens - 1, 1 + 3)}
        assert out.spec_token_ids == {"a": [81, 82, 83]}
    else:   # all accepted: no rollback, the new drafts at once
        assert cols(out) == {"a": (10, 1 + 3)} and out.spec_token_ids == {"a": [70, 71, 72]}
    assert out.state_restores == [(sa, ba)]
    # Non-hybrids roll nothing back: they compute nothing again.
    n = sched()
    b = req("b", 6)
    start(n, b, proposals={"b": [51, 52, 53]})
    n.update_from_output(n.schedule(), {"b": answer}, {})
    assert n.spec_num_recomputed_tokens == 0 and b.num_computed_tokens == b.num_tokens - 1


def test_hybrid_recomputed_tokens_add_up_over_rows_and_steps():
    s = hybrid(k=2)
    a, b = req("a", 3), req("b", 5)
    start(s, a, b, proposals={"a": [51, 52], "b": [61, 62]})
    out = s.schedule()   # a from 3, b from 5
    assert cols(out) == {"a": (3, 3), "b": (5, 3)}
    s.update_from_output(out, {"a": [51, 60], "b": [70]}, {"a": [61, 62], "b": [71, 72]})
    assert s.spec_num_recomputed_tokens == 2 + 1
    out = s.schedule()   # a from 3 again (3 known), b from 5 (2): no drafts
    assert cols(out) == {"a": (3, 3), "b": (5, 2)} and out.spec_token_ids == {}
    s.update_from_output(out, {"a": 61, "b": 71}, {"a": [62, 63], "b": [72, 73]})
    assert s.spec_num_recomputed_tokens == 2 + 1   # computing them again adds nothing
    out = s.schedule()   # each from its last known token, with its drafts
    assert cols(out) == {"a": (6, 3), "b": (7, 3)}
    s.update_from_output(out, {"a": [62, 9], "b": [72, 73, 74]}, {})
    # a: 61, 62 at 6..7 again (not 9, sampled last): 2; b: nothing.
    assert s.spec_num_recomputed_tokens == 3 + 2
    assert a.num_computed_tokens == 6 and a.num_tokens == 9
    assert b.num_computed_tokens == b.num_tokens - 1 == 10


def test_hybrid_rollback_past_the_budget_recomputes_in_chunks():
    # After a rollback a request has several known tokens to compute again; no chunk of
    # them verifies drafts (nor keeps a backup), short of its last one or reaching it:
    # the step after, from its last known token alone, takes them.
    s = hybrid(budget=4, k=2)
    b, a = req("b", 2), req("a", 2)
    start(s, b, a, first={"b": 40, "a": 50}, proposals={"a": [51, 52]})
    sa, ba = slots(s, "a")
    sb, bb = slots(s, "b")
    out = s.schedule()
    assert cols(out) == {"b": (2, 1), "a": (2, 3)} and out.state_restores == [(sa, ba)]
    s.update_from_output(out, {"b": 41, "a": [51, 60]}, {"b": [42, 43], "a": [61, 62]})
    assert a.num_computed_tokens == 2 and a.num_tokens == 5   # 2..4 to compute again
    out = s.schedule()
    # b takes 1 + 2; the one token left for a is short of its last known token.
    assert cols(out) == {"b": (3, 3), "a": (2, 1)}
    assert out.spec_token_ids == {"b": [42, 43]}
    assert out.state_restores == [(ba, sa), (sb, bb)]
    s.update_from_output(out, {"b": [42, 43, 44]}, {"b": []})   # a sampled nothing
    assert a.output_token_ids == [50, 51, 60] and a.spec_token_ids == [61, 62]
    out = s.schedule()
    # a's last 2 known tokens, its drafts still pending (room for 1 of them): no backup.
    assert cols(out) == {"b": (6, 1), "a": (3, 2)}
    assert out.spec_token_ids == {} and out.state_restores == []
    s.update_from_output(out, {"b": 45, "a": 63}, {"b": [], "a": [64, 65]})
    assert a.output_token_ids == [50, 51, 60, 63]
    assert a.num_computed_tokens == a.num_tokens - 1 == 5
    out = s.schedule()
    # a's last known token and 2 drafts (the budget b leaves); a backup again, b none.
    assert cols(out) == {"b": (7, 1), "a": (5, 3)}
    assert out.spec_token_ids == {"a": [64, 65]} and out.state_restores == [(sa, ba)]
    s.update_from_output(out, {"b": 46, "a": [64, 65, 66]}, {})
    assert a.output_token_ids == [50, 51, 60, 63, 64, 65, 66]
    assert a.num_computed_tokens == a.num_tokens - 1


@pytest.mark.parametrize("accepted", [0, 2])
def test_hybrid_rejections_never_run_away(accepted):
    # Drafts rejected at every try (all of them, or all but `accepted`): each rejection
    # costs one step that computes from the rolled-back start to the last known token
    # (accepted + 2 tokens, at most 1 + k) without drafts, and the step after drafts
    # again from the last known token. Were the recomputing row to draft, its backup
    # would be its state before the tokens it recomputes, and each rejection would roll
    # it back there again, over a range growing by a token or more every time.
    k = 3
    s = hybrid(k=k)
    a = req("a", 6, max_tokens=None)
    drafts = [7, 8, 9]
    start(s, a, proposals={"a": drafts})
    sa, ba = slots(s, "a")
    scheduled = []
    for step in range(10):
        known, recomputed = a.num_tokens, s.spec_num_recomputed_tokens
        out = s.schedule()
        (rid, begin, n), = out.scheduled()
        scheduled.append((begin, n))
        assert a.num_computed_tokens == begin + n and n <= 1 + k
        if step % 2 == 0:   # its last known token alone, and its drafts
            assert (begin, n) == (known - 1, 1 + k)
            assert out.spec_token_ids == {"a": drafts}
            assert out.state_restores == [(sa, ba)]
            s.update_from_output(out, {"a": drafts[:accepted] + [60 + step]},
                                 {"a": drafts})
            # Back to this step's start: the accepted drafts and the token sampled
            # after them to compute again, with the last known token (counted).
            assert a.num_computed_tokens == begin
            assert a.num_tokens - begin == accepted + 2 <= 1 + k
            assert s.spec_num_recomputed_tokens == recomputed + accepted + 1
        else:   # from where the rollback left it, to its last known token, no drafts
            assert begin == scheduled[-2][0] and n == known - begin == accepted + 2
            assert out.spec_token_ids == {} and out.state_restores == [(ba, sa)]
            s.update_from_output(out, {"a": 60 + step}, {"a": drafts})
            assert a.num_computed_tokens == a.num_tokens - 1
            assert s.spec_num_recomputed_tokens == recomputed
    # Every two steps it moves on by accepted + 2 tokens, whatever it rejects.
    step = accepted + 2
    assert scheduled == [(6 + step * (i // 2), 1 + k if i % 2 == 0 else step)
                         for i in range(10)]
    assert a.num_computed_tokens == 6 + 5 * step and a.num_tokens == 6 + 5 * step + 1
    assert s.spec_num_recomputed_tokens == 5 * (accepted + 1)
    assert s.spec_num_drafts == 5
    assert s.stats().spec_accepted_per_pos == (5,) * accepted + (0,) * (k - accepted)


def test_hybrid_stop_or_abort_drops_the_pending_rollback():
    s = hybrid()
    a, b = req("a", 6), req("b", 6)
    start(s, a, b, proposals={"a": [51, EOS, 53], "b": [61, 62]})
    out = s.schedule()
    # a: rejects its third draft but stops at EOS (accepted): released, no rollback left.
    # b: rejects, then is aborted before the next step.
    s.update_from_output(out, {"a": [51, EOS, 9], "b": [60]}, {"b": [1]})
    assert a.status == RequestStatus.FINISHED_STOPPED
    s.abort_requests("b")
    assert s.kv.state_slots.num_free == 8
    out = s.schedule()
    assert out.state_restores == [] and out.num_scheduled_tokens == 0


def test_dropping_drafts_avoids_preemption_fcfs():
    # a's drafts would need a third page and none is free: a drops them (not b), verifies
    # nothing this step and keeps them pending; b keeps its row (it computes again what
    # its rollback undid, without drafts).
    s = hybrid(num_pages=5)   # 4 usable pages
    a, b = req("a", 3), req("b", 3)
    start(s, a, b, proposals={"a": [51, 52, 53], "b": [61, 62, 63]})
    sb, bb = slots(s, "b")
    out = s.schedule()
    assert cols(out) == {"a": (3, 4), "b": (3, 4)} and s.kv.get_num_free_pages() == 0
    s.update_from_output(out, {"a": [51, 52, 53, 54], "b": [70]},
                         {"a": [55, 56, 57], "b": [71]})
    assert b.num_computed_tokens == 3   # hybrid: back to the step's start
    out = s.schedule()   # a's positions 7..10 would need a third page; 7 alone does not
    assert out.preempted_req_ids == [] and s.num_preemptions == 0
    assert cols(out) == {"a": (7, 1), "b": (3, 2)} and out.spec_token_ids == {}
    # b's rollback only: neither verifies drafts, so no backup.
    assert out.state_restores == [(bb, sb)]
    assert a.spec_token_ids == [55, 56, 57] and a.num_computed_tokens == 8
    assert b.spec_token_ids == [71] and b.num_computed_tokens == 5
    assert len(s.kv.get_page_ids("a")) == 2 and s.kv.get_num_free_pages() == 0
    # Neither verified drafts: each answers with a plain token.
    s.update_from_output(out, {"a": 58, "b": 72}, {"a": [59], "b": []})
    assert a.output_token_ids == [50, 51, 52, 53, 54, 58] and a.spec_token_ids == [59]
    assert b.output_token_ids == [51, 70, 72] and b.num_computed_tokens == b.num_tokens - 1


def test_preemption_drops_drafts_and_pending_copies_fcfs():
    # a's last known token (position 8) needs a third page even without its drafts: they
    # go first, then b (last running) is the victim -- its drafts too, and the rollback
    # pair its rejection left for this step. a does not get its drafts back.
    s = hybrid(num_pages=5)   # 4 usable pages
    a, b = req("a", 4), req("b", 3)
    start(s, a, b, proposals={"a": [51, 52, 53], "b": [61, 62, 63]})
    sb, bb = slots(s, "b")
    out = s.schedule()
    assert cols(out) == {"a": (4, 4), "b": (3, 4)} and s.kv.get_num_free_pages() == 0
    s.update_from_output(out, {"a": [51, 52, 53, 54], "b": [70]},
                         {"a": [55, 56, 57], "b": [71]})
    assert b.num_computed_tokens == 3   # hybrid: back to the step's start
    assert s.kv._restores == [(bb, sb)]   # (white-box: b's rollback is pending)
    out = s.schedule()
    assert out.preempted_req_ids == ["b"]
    assert cols(out) == {"a": (8, 1)} and out.spec_token_ids == {}
    assert out.num_scheduled_tokens == 1
    assert out.state_restores == []   # no (bb, sb) for b's freed slots; a: no backup
    assert a.spec_token_ids == [55, 56, 57]
    assert b.spec_token_ids == [] and b.num_computed_tokens == 0
    assert b.status == RequestStatus.PREEMPTED
    assert s.kv.state_slots.num_free == 8 - 2
    assert len(s.kv.get_page_ids("a")) == 3 and s.kv.get_num_free_pages() == 1


def test_preemption_undoes_a_victim_scheduled_with_drafts_priority():
    # x (lowest priority, running first) is scheduled with drafts -- its rollback and
    # backup pairs queued -- then y needs a page even without its drafts: y drops them,
    # then x is undone, its drafts, budget and pairs too.
    s = hybrid(num_pages=4, policy="priority")   # 3 usable pages
    x = req("x", 3, t=0.0, priority=5)
    y = req("y", 4, t=1.0, priority=0)
    start(s, x, proposals={"x": [51, 52, 53]})   # admitted before y arrives
    sx, bx = slots(s, "x")
    s.add_request(y)
    out = s.schedule()
    assert cols(out) == {"x": (3, 4), "y": (0, 4)} and s.kv.get_num_free_pages() == 0
    sy, by = slots(s, "y")
    s.update_from_output(out, {"x": [54], "y": 60}, {"x": [55, 56], "y": [61, 62, 63]})
    assert x.num_computed_tokens == 3   # rolled back: (bx, sx) pending
    out = s.schedule()
    assert [r.request_id for r in s.running] == ["y"] and out.preempted_req_ids == ["x"]
    assert cols(out) == {"y": (4, 1)} and out.num_scheduled_tokens == 1
    assert out.spec_token_ids == {}
    assert out.state_restores == []   # none of x's pairs; y verifies nothing: no backup
    assert y.spec_token_ids == [61, 62, 63]   # pending, verified in a later step
    assert x.spec_token_ids == [] and x.status == RequestStatus.PREEMPTED
    assert "x" not in s.kv.req_pages and s.kv.state_slots.num_free == 8 - 2
    assert len(s.kv.get_page_ids("y")) == 2 and s.kv.get_num_free_pages() == 1
    s.update_from_output(out, {"y": 64}, {"y": [65, 66, 67]})
    out = s.schedule()   # y: 5..8 would need a 3rd page, the free one: its drafts fit
    assert cols(out) == {"y": (5, 4)} and out.spec_token_ids == {"y": [65, 66, 67]}
    assert out.state_restores == [(sy, by)]


def test_dropping_drafts_avoids_preemption_non_hybrid():
    s = sched(num_pages=5, policy="priority")   # 4 usable pages
    x = req("x", 3, t=0.0, priority=5)
    y = req("y", 8, t=1.0, priority=0)
    start(s, x, y, first={"x": 50, "y": 60}, proposals={"x": [51, 52, 53], "y": [61, 62, 63]})
    assert [r.request_id for r in s.running] == ["y", "x"]
    # y: 8..11 takes the last free page (a 3rd); x: 3..6 would need a 2nd, 3 alone not.
    out = s.schedule()
    assert out.preempted_req_ids == [] and s.num_preemptions == 0
    assert cols(out) == {"y": (8, 4), "x": (3, 1)}
    assert out.spec_token_ids == {"y": [61, 62, 63]}
    assert x.spec_token_ids == [51, 52, 53] and len(s.kv.get_page_ids("x")) == 1
    s.update_from_output(out, {"y": [64], "x": 51}, {"y": [], "x": [52]})
    assert x.output_token_ids == [50, 51] and y.output_token_ids == [60, 64]


def test_preemption_drops_drafts_non_hybrid():
    # x's last known token (position 4) needs a 2nd page even without its drafts, and
    # none is free: x, the lowest priority, is its own victim.
    s = sched(num_pages=5, policy="priority")   # 4 usable pages
    x = req("x", 4, t=0.0, priority=5)
    y = req("y", 7, t=1.0, priority=0)
    start(s, x, y, first={"x": 50, "y": 60}, proposals={"x": [51, 52, 53], "y": [61, 62, 63]})
    out = s.schedule()   # y: 7..10 (a 3rd page, the last free one); x: 4 (a 2nd)
    assert out.preempted_req_ids == ["x"] and [r.request_id for r in s.running] == ["y"]
    assert cols(out) == {"y": (7, 4)} and out.spec_token_ids == {"y": [61, 62, 63]}
    assert x.spec_token_ids == [] and x.num_computed_tokens == 0
    assert x.status == RequestStatus.PREEMPTED and "x" not in s.kv.req_pages
    s.update_from_output(out, {"y": [61, EOS]}, {"y": [1]})   # y stops: its pages free
    assert y.status == RequestStatus.FINISHED_STOPPED
    # x resumes whole (prompt + its output) and verifies nothing until it proposes again.
    out = s.schedule()
    assert [(r.req_id, r.output_token_ids) for r in out.new_reqs] == [("x", [50])]
    assert out.spec_token_ids == {}


# ---- lookahead pages (a model drafter writes its KV past the step's tokens) ---------------

def pages(s, rid):
    return len(s.kv.get_page_ids(rid))


def test_lookahead_pages_past_a_chunk_that_reaches_the_last_token():
    s = sched(num_lookahead_tokens=3)
    a = req("a", 6)
    start(s, a, proposals={"a": [51, 52, 53]})
    # The prompt (0..5) reaches its end: pages for 3 positions more (6..8), 3 pages.
    assert pages(s, "a") == 3
    out = s.schedule()   # 6..9 (the drafts' positions too) and 10..12 ahead: 4 pages
    assert cols(out) == {"a": (6, 4)} and out.cached_reqs.new_page_ids[0] == ([4],)
    assert pages(s, "a") == 4
    s.update_from_output(out, {"a": [51, 52, 53, 54]}, {})
    out = s.schedule()   # no drafts: 10 and 11..13 ahead, still 4 pages
    assert cols(out) == {"a": (10, 1)} and pages(s, "a") == 4
    s.update_from_output(out, {"a": 55}, {})
    s.update_from_output(s.schedule(), {"a": 56}, {})   # 11, 12..14
    assert pages(s, "a") == 4
    s.update_from_output(s.schedule(), {"a": 57}, {})   # 12, 13..15
    assert pages(s, "a") == 4
    out = s.schedule()   # 13, 14..16: a 5th page, 3 positions before the chunk needs it
    assert cols(out) == {"a": (13, 1)} and pages(s, "a") == 5
    # Without lookahead: the prompt's 2 pages, then the drafts' 3.
    s = sched()
    a = req("a", 6)
    start(s, a, proposals={"a": [51, 52, 53]})
    assert pages(s, "a") == 2
    s.schedule()
    assert pages(s, "a") == 3


def test_no_lookahead_pages_for_a_chunk_short_of_the_end():
    s = sched(budget=4, num_lookahead_tokens=3)
    a = req("a", 10)
    s.add_request(a)
    out = s.schedule()   # 0..3 stops short of 9: no page ahead
    assert [r.num_new_tokens for r in out.new_reqs] == [4] and pages(s, "a") == 1
    s.update_from_output(out, {}, {})
    out = s.schedule()   # 4..7: still none
    assert cols(out) == {"a": (4, 4)} and pages(s, "a") == 2
    s.update_from_output(out, {}, {})
    out = s.schedule()   # 8..9 reaches the end: 10..12 ahead
    assert cols(out) == {"a": (8, 2)} and pages(s, "a") == 4


def test_lookahead_is_capped_by_max_len():
    s = sched(max_model_len=12, num_lookahead_tokens=3)
    a = req("a", 10, max_tokens=None)
    start(s, a)
    assert pages(s, "a") == 3   # 0..9 and 2 ahead (10, 11): max_len 12, not 13
    out = s.schedule()   # 10 and 1 ahead
    assert cols(out) == {"a": (10, 1)} and pages(s, "a") == 3
    # The pool's limit too: 3 usable pages make max_len 12; without the cap this
    # request could never be admitted.
    s = sched(num_pages=4, num_lookahead_tokens=3)
    assert s.max_len == 12
    a = req("a", 10)
    start(s, a)
    assert pages(s, "a") == 3 and s.kv.get_num_free_pages() == 0


def test_lookahead_pages_go_before_anyone_is_preempted():
    s = sched(num_pages=5, num_lookahead_tokens=3)   # 4 usable pages
    a, b = req("a", 4), req("b", 4)
    start(s, a, b)
    assert pages(s, "a") == pages(s, "b") == 2 and s.kv.get_num_free_pages() == 0
    out = s.schedule()   # 4 and 5..7 ahead: the 2 pages hold it
    s.update_from_output(out, {"a": 60, "b": 70}, {"a": [61], "b": [71, 72, 73]})
    out = s.schedule()
    # a: 5..6 and 7..9 ahead, b: 5..8 and 9..11 would need a 3rd page each; without
    # their drafts and pages ahead (both go, though a's draft alone would fit) 5 fits.
    assert out.preempted_req_ids == [] and s.num_preemptions == 0
    assert cols(out) == {"a": (5, 1), "b": (5, 1)} and out.spec_token_ids == {}
    assert pages(s, "a") == pages(s, "b") == 2
    assert a.spec_token_ids == [61] and b.spec_token_ids == [71, 72, 73]
    s.update_from_output(out, {"a": 62, "b": 74}, {})
    assert a.output_token_ids == [50, 60, 62] and b.output_token_ids == [51, 70, 74]
    # No drafts at all: 6 and 7..9 ahead would need a 3rd page; the pages ahead go.
    out = s.schedule()
    assert out.preempted_req_ids == [] and s.num_preemptions == 0
    assert cols(out) == {"a": (6, 1), "b": (6, 1)}
    assert pages(s, "a") == pages(s, "b") == 2


# ---- the prefix cache ------------------------------------------------------------------

def cached_hashes(s):
    return set(s.kv.pool.cached_pages)


def test_prefix_cache_never_registers_draft_positions():
    s = sched()
    p = list(range(100, 106))
    a = req("a", p)
    start(s, a, proposals={"a": [51, 52, 53]})
    assert cached_hashes(s) == set(a.page_hashes[:1])
    out = s.schedule()   # positions 6..9; 7..9 are drafts: page 1 (4..7) is not full of
    assert cols(out) == {"a": (6, 4)}     # known tokens
    assert cached_hashes(s) == set(a.page_hashes[:1])
    # A request whose prompt continues with a's drafts finds only the first page.
    b = req("b", p + [50, 51, 52, 53, 54])
    s.add_request(b)
    out_b = s.schedule()
    assert [(r.req_id, r.num_computed_tokens) for r in out_b.new_reqs] == [("b", 4)]
    # a rejects: its page 1 will hold 50, 60 at 6..7 (not the draft 51).
    s.update_from_output(out, {"a": [60]}, {"a": [61, 62, 63]})
    s.update_from_output(out_b, {"b": 70}, {})
    out = s.schedule()
    assert cols(out) == {"a": (7, 4), "b": (11, 1)}
    want = hash_page_tokens(a.page_hashes[0], (104, 105, 50, 60))
    assert a.page_hashes[1] == want
    assert want in cached_hashes(s)
    assert hash_page_tokens(a.page_hashes[0], (104, 105, 50, 51)) == b.page_hashes[1]
    # Every registered page is full of some request's known tokens.
    known = set(a.page_hashes) | set(b.page_hashes)
    assert cached_hashes(s) <= known
    assert s.kv.req_pages["a"].num_cached == 2 == a.num_tokens // PS


def test_prefix_cache_registers_accepted_drafts_as_known_tokens():
    s = sched()
    a = req("a", 6)
    start(s, a, proposals={"a": [51, 52, 53]})
    out = s.schedule()
    s.update_from_output(out, {"a": [51, 52, 53, 54]}, {})
    assert a.num_tokens == 11 and a.num_computed_tokens == 10
    # Pages 1 (4..7) and 2 (8..11): page 1 is full of known tokens now, registered
    # when the next step is scheduled (its KV was written by the verifying step).
    assert cached_hashes(s) == set(a.page_hashes[:1])
    s.schedule()
    assert cached_hashes(s) == set(a.page_hashes[:2])


# ---- statistics ------------------------------------------------------------------------

def test_spec_stats():
    s = sched(k=3)
    a, b, c = req("a", 6), req("b", 6), req("c", 6)
    start(s, a, b, c, proposals={"a": [51, 52, 53], "b": [61, 62], "c": []})
    out = s.schedule()
    s.update_from_output(out, {"a": [51, 52, 9], "b": [8], "c": 7},
                         {"a": [11, 12, 13], "b": [4]})
    st = s.stats()
    assert (st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens) == \
        (2, 5, 2)
    assert st.spec_accepted_per_pos == (1, 1, 0)
    out = s.schedule()
    s.update_from_output(out, {"a": [11, 12, 13, 5], "b": [4, 6], "c": 8}, {})
    st = s.stats()
    assert (st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens) == \
        (4, 9, 6)
    assert st.spec_accepted_per_pos == (3, 2, 1)
    # Generation tokens count every token kept: 3 prefills, then 3+1+1, then 4+2+1.
    assert st.num_generation_tokens == 3 + 5 + 7
    out = s.schedule()   # no drafts now: nothing more counted
    s.update_from_output(out, {"a": 1, "b": 1, "c": 1}, {})
    assert s.stats().spec_num_drafts == 4 and s.stats().spec_accepted_per_pos == (3, 2, 1)


def test_spec_stats_without_speculation():
    s = sched(k=0)
    a = req("a", 6)
    start(s, a)
    st = s.stats()
    assert st.spec_accepted_per_pos == () and st.spec_num_drafts == 0
