"""The persistent batch, model-free: a real Scheduler's diffs applied to an InputBatch
give, every step, the same device inputs and sampling tensors as a full copy of each
scheduled request built from the scheduler's own state (the path the diffs replaced),
under random arrivals, aborts, preemption, prefix hits, chunked prefill, hybrid state
slots, penalties, min_tokens and prompt logprobs -- and, for a sliding-window KV group,
its slot mapping and page table from its own page ids."""
from __future__ import annotations

import random

import numpy as np
import pytest

from jaxserve.core.kv_cache_manager import SLIDING
from jaxserve.core.request import Request
from jaxserve.core.scheduler import CachedRequestData, Scheduler, SchedulerConfig, SchedulerOutput
from jaxserve.engine.bad_words import BadWords
from jaxserve.runner.buckets import pick_bucket, power_of_two_buckets
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.sampling_tensors import SamplingRow, make_sampling_tensors
from jaxserve.sampling_params import SamplingParams

PS, V, EOS, MML, R = 4, 97, 2, 48, 4
BUCKETS = power_of_two_buckets(16, 16)


def full_copy_inputs(sched: Scheduler, out, width: int, group: int = 0
                     ) -> dict[str, np.ndarray]:
    """The device inputs built the old way: from each request's whole state (its pages
    in KV group `group`)."""
    tokens, pos, slots, qsl, seq_lens = [], [], [], [0], []
    pt = np.zeros((R, width), np.int32)
    state = np.zeros(R, np.int32)
    for i, (rid, start, n) in enumerate(out.scheduled()):
        req = sched.get_request(rid)
        pages = sched.kv.get_page_ids(rid, group)
        tokens += req.all_token_ids[start:start + n]
        pos += range(start, start + n)
        slots += [pages[p // PS] * PS + p % PS for p in range(start, start + n)]
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        pt[i, :len(pages)] = pages
        state[i] = sched.kv.get_state_slot(rid)
    t, n_req = pick_bucket(BUCKETS, len(tokens)), len(seq_lens)
    pad = lambda xs, size: np.array(list(xs) + [0] * (size - len(xs)), np.int32)  # noqa: E731
    return dict(token_ids=pad(tokens, t), positions=pad(pos, t), slot_mapping=pad(slots, t),
                query_start_loc=pad(qsl, R + 1) + np.array([0] * (n_req + 1) + [qsl[-1]] *
                                                          (R - n_req), np.int32),
                seq_lens=pad(seq_lens, R), page_table=pt, num_seqs=np.array([n_req], np.int32),
                state_slots=state)


def full_copy_rows(sched: Scheduler, out) -> list[SamplingRow]:
    rows = []
    for rid, _, _ in out.scheduled():
        req = sched.get_request(rid)
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        eos = () if sp.ignore_eos else (EOS,)
        banned = () if n_out >= sp.min_tokens else eos + tuple(sp.stop_token_ids)
        rows.append(SamplingRow(sp, n_out, prompt_token_ids=req.prompt_token_ids,
                                output_token_ids=list(req.output_token_ids),
                                banned_token_ids=banned))
    return rows


def random_params(rng: random.Random) -> SamplingParams:
    kind, max_tokens = rng.randrange(5), rng.randrange(1, 12)
    return SamplingParams(
        max_tokens=max_tokens, ignore_eos=rng.random() < 0.5, seed=rng.randrange(1000),
        temperature=0.0 if kind == 0 else 0.7,
        top_k=5 if kind == 1 else 0, top_p=0.9 if kind == 2 else 1.0,
        repetition_penalty=1.3 if kind == 3 else 1.0,
        presence_penalty=0.5 if kind == 3 else 0.0,
        min_tokens=rng.randrange(0, min(4, max_tokens + 1)),
        stop_token_ids=[5] if kind == 4 else None,
        logprobs=2 if kind == 2 else None, prompt_logprobs=1 if kind == 4 else None,
        **random_constraints(rng))


def random_constraints(rng: random.Random) -> dict:
    """Fixed token constraints on some requests (a mask row, bias entries): rows moved
    by aborts and preemption must carry them."""
    which = rng.randrange(4)
    if which == 1:
        return dict(allowed_token_ids=rng.sample(range(V), rng.randrange(1, 20)))
    if which == 2:
        return dict(logit_bias={t: rng.uniform(-5, 5) for t in rng.sample(range(V), 3)})
    if which == 3:   # as the input processor sets them from bad_words
        return dict(bad_words=["x"], bad_words_automaton=BadWords([(rng.randrange(V),)]))
    return {}


def check_sliding(sched: Scheduler, out, inputs, num_reqs: int) -> int:
    """The sliding slot mapping is the scheduler's exactly; the sliding page table is
    too from each row's window on (before it the scheduler has the null page where the
    runner may keep ids of pages given back). -> stale ids seen."""
    width = inputs.sliding_page_table.shape[1]
    want = full_copy_inputs(sched, out, width, SLIDING)
    np.testing.assert_array_equal(inputs.sliding_slot_mapping, want["slot_mapping"])
    got_pt, want_pt = inputs.sliding_page_table, want["page_table"]
    np.testing.assert_array_equal(got_pt[num_reqs:], 0)
    stale = 0
    for i, (_, start, _) in enumerate(out.scheduled()):
        first = max(start - sched.kv.sliding_window + 1, 0) // PS
        np.testing.assert_array_equal(got_pt[i, first:], want_pt[i, first:])
        assert not want_pt[i, :first].any()
        stale += int(got_pt[i, :first].astype(bool).sum())
    return stale


@pytest.mark.parametrize("hybrid,window", [(False, None), (True, None), (False, 6)])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_diffs_rebuild_the_full_copy(policy, hybrid, window):
    rng = random.Random(7)
    sched = Scheduler(SchedulerConfig(
        num_pages=11, page_size=PS, max_num_seqs=R, max_num_batched_tokens=16, max_model_len=MML,
        policy=policy, num_state_slots=R + 1 if hybrid else 0,
        num_sliding_pages=10 if window else 0, sliding_window=window))
    batch = InputBatch(max_num_seqs=R, max_model_len=MML, page_size=PS, token_buckets=BUCKETS,
                       vocab_size=V, page_buckets=(4, 8, 12), sliding=window is not None)
    prefixes = [[rng.randrange(3, V) for _ in range(9)] for _ in range(2)]
    n_added = 0
    seen = dict(prefix_hits=0, chunks=0, prompt_lps=0, stale=0)
    for t in range(300):
        if n_added < 30 and rng.random() < 0.3:
            prompt = (prefixes[rng.randrange(2)][:rng.randrange(0, 10)]
                      + [rng.randrange(3, V) for _ in range(rng.randrange(1, 14))])
            sched.add_request(Request(f"r{n_added}", prompt, random_params(rng), eos_token_id=EOS,
                                      arrival_time=float(t), priority=rng.randrange(3),
                                      page_size=PS))
            n_added += 1
        if rng.random() < 0.03 and sched.running:
            sched.abort_requests(rng.choice(sched.running).request_id)
        out = sched.schedule()
        rows = batch.update(out, (EOS,))
        assert set(batch.row_of) == {r.request_id for r in sched.running}
        assert sorted(batch.row_of.values()) == list(range(batch.num_rows))
        seen["prefix_hits"] += sum(r.num_computed_tokens > 0 for r in out.new_reqs)
        seen["chunks"] += int((~rows.sample).sum())
        if rows.num_reqs:
            hb = batch.build(rows)
            width = hb.inputs.page_table.shape[1]
            want = full_copy_inputs(sched, out, width)
            for name, value in want.items():
                np.testing.assert_array_equal(getattr(hb.inputs, name), value, err_msg=name)
            if window:
                seen["stale"] += check_sliding(sched, out, hb.inputs, rows.num_reqs)
            else:   # every other model's inputs are as before
                assert hb.inputs.sliding_slot_mapping is None
                assert hb.inputs.sliding_page_table is None
            np.testing.assert_array_equal(hb.logits_indices[:rows.num_reqs],
                                          want["query_start_loc"][1:rows.num_reqs + 1] - 1)
            penalties = bool(batch.has_penalties[rows.rows].any())
            got = batch.sampling_tensors(rows, 8, penalties=penalties, penalty_len=MML)
            ref = make_sampling_tensors(full_copy_rows(sched, out), 8, V, penalties=penalties,
                                        penalty_len=MML)
            for name in ref.__dataclass_fields__:
                a, b = getattr(got, name), getattr(ref, name)
                if b is None:
                    assert a is None, name
                else:
                    np.testing.assert_array_equal(a, b, err_msg=name)
            targets, spans = batch.prompt_logprob_targets(rows, hb.inputs.query_start_loc, 16)
            for rid, at, n, first in spans:
                req = sched.get_request(rid)
                assert list(targets[at:at + n]) == req.prompt_token_ids[first + 1:first + 1 + n]
                seen["prompt_lps"] += 1
        sampled = np.array([rng.randrange(3, V) for _ in range(rows.num_reqs)], np.int32)
        batch.append_sampled(rows, sampled)
        sched.update_from_output(out, {rid: int(tok) for rid, tok, s in
                                       zip(rows.req_ids, sampled, rows.sample) if s})
        if t > 200 and not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests()
    batch.update(sched.schedule(), (EOS,))
    assert batch.num_rows == 0 and not batch.row_of and not batch.page_table.any()
    assert not window or not batch.sliding_page_table.any()
    assert sched.num_preemptions > 0 and seen["chunks"] > 0 and seen["prompt_lps"] > 0
    assert seen["prefix_hits"] > 0 or hybrid   # hybrid models never share pages
    assert seen["stale"] > 0 or not window


def test_a_diff_the_batch_cannot_apply_is_refused():
    sched = Scheduler(SchedulerConfig(
        num_pages=11, page_size=PS, max_num_seqs=R, max_num_batched_tokens=16, max_model_len=MML))
    new_batch = lambda: InputBatch(max_num_seqs=R, max_model_len=MML, page_size=PS,  # noqa: E731
                                   token_buckets=BUCKETS, vocab_size=V)
    batch = new_batch()
    sched.add_request(Request("a", [7, 8, 9], SamplingParams(max_tokens=4), page_size=PS))
    out = sched.schedule()
    batch.update(out, (EOS,))
    sched.update_from_output(out, {"a": 11})
    # The runner never stored the sampled token: the next step asks for what it lacks.
    with pytest.raises(ValueError, match="the runner knows 3"):
        batch.update(sched.schedule(), (EOS,))
    running_a = SchedulerOutput([], CachedRequestData(["a"], [3], [1], [([],)]), 1, [], [])
    with pytest.raises(ValueError, match="not in the runner's batch"):
        new_batch().update(running_a, (EOS,))
    with pytest.raises(ValueError, match="already in the runner's batch"):
        batch.update(SchedulerOutput(out.new_reqs, CachedRequestData.empty(), 3, [], []), (EOS,))
