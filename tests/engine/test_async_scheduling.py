"""Async scheduling (--async-scheduling): the engine dispatches step N+1 before it reads
step N's tokens, and every request still gets the tokens (and float32 logprobs) it gets
with steps in order: staggered arrivals with chunked prefill, preemption (a tight pool),
aborts while a step is in flight, n > 1, stop strings and stop_token_ids, min_tokens,
max_tokens, prefix-cache hits and seeded random sampling. Nothing leaks and nothing
compiles after warmup; a request that needs each step's tokens first (penalties) makes
steps run in order while it is unfinished."""
from __future__ import annotations

import logging
import random

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from tests.engine.conftest import add, assert_no_leaks, prompt_workload

PREFIX_LEN = 20   # more than a page of 16: later requests hit it in the prefix cache
ABORTS = {9: "4", 23: "7"}   # step -> request aborted then (the same step in both runs)
SETTINGS = dict(dtype="float32", max_model_len=96, max_num_seqs=4,
                max_num_batched_tokens=32, num_pages=9)


def _params(i: int) -> SamplingParams:
    base = dict(max_tokens=6 + 3 * (i % 5), ignore_eos=True, temperature=0.0, logprobs=2)
    kinds = [
        {},
        {"n": 2},
        {"temperature": 0.9, "top_p": 0.9, "seed": 1234 + i},
        {"min_tokens": 4, "stop_token_ids": [7, 9, 11, 13], "ignore_eos": False},
        {"stop": ["a", "e", "o"]},
        {"max_tokens": 1},
    ]
    return SamplingParams(**{**base, **kinds[i % len(kinds)]})


def _workload(num: int) -> list[tuple[list[int], SamplingParams]]:
    return prompt_workload(11, num, _params, PREFIX_LEN, max_tail=40)


def _summary(out) -> tuple:
    return tuple((tuple(c.token_ids), c.finish_reason, c.text,
                  tuple(round(d[t].logprob, 3) for d, t in zip(c.logprobs, c.token_ids)))
                 for c in out.outputs)


def _run(core, items, aborts: dict[int, str] = ABORTS) -> dict[str, tuple]:
    """Two arrivals every third step, `aborts` at their steps; -> finished outputs."""
    pending = list(enumerate(items))
    got, step = {}, 0
    while pending or core.has_unfinished_requests():
        for _ in range(2 if step % 3 == 0 else 0):
            if pending:
                i, (prompt, params) = pending.pop(0)
                add(core, str(i), prompt, params)
        if step in aborts:
            core.abort_request(aborts[step])
        for o in core.step():
            assert o.error is None
            if o.finished:
                got[o.request_id] = _summary(o)
        step += 1
    return got


class Overlaps:
    """Counts the runner's dispatches made while an earlier step was not yet collected."""

    def __init__(self, runner):
        self.open, self.count = 0, 0
        dispatch, collect = runner.dispatch, runner.collect

        def counted_dispatch(sched_out):
            self.count += self.open > 0
            self.open += 1
            return dispatch(sched_out)

        def counted_collect(step):
            self.open -= 1
            return collect(step)
        runner.dispatch, runner.collect = counted_dispatch, counted_collect


@pytest.fixture(scope="module")
def engines(checkpoint):
    """(steps in order, async): the async one warmed up (compilations are counted)."""
    path = checkpoint("llama")
    in_order = LLM(path, enforce_eager=True, **SETTINGS).engine
    overlapped = LLM(path, async_scheduling=True, **SETTINGS).engine
    assert overlapped.async_scheduling and not in_order.async_scheduling
    return in_order, overlapped


def test_async_scheduling_gives_the_outputs_of_steps_in_order(engines):
    in_order, core = engines
    items = _workload(16)
    want = _run(in_order, items)
    compiled = core.num_compilations
    overlaps = Overlaps(core.runner)
    got = _run(core, items)
    assert core.num_compilations == compiled, "compiled after warmup"
    aborted = set(ABORTS.values())
    assert set(want) == set(got) == {str(i) for i in range(len(items))} - aborted
    for rid in want:
        assert got[rid] == want[rid], (rid, items[int(rid)][1])
    assert overlaps.count > 20 and core.num_overlapped_steps >= overlaps.count
    assert core.scheduler.num_preemptions > 0
    assert core.stats().prefix_cache_hits > 0
    assert any(o[1] == "stop" for rid in got for o in got[rid])
    for engine in engines:
        engine.step()   # the last finished ids reach the runner
        assert engine.runner.batch.num_rows == 0
        assert_no_leaks(engine)


def test_penalties_run_steps_in_order_while_unfinished(engines, caplog):
    in_order, core = engines
    plain = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    penalised = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0,
                               repetition_penalty=1.5, frequency_penalty=0.5)
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41, 42, 43]]
    want = {}
    for engine in engines:
        outs = {}
        before = core.num_overlapped_steps
        with caplog.at_level(logging.INFO, logger="jaxserve"):
            add(engine, "p", prompts[0], penalised)
            while engine.has_unfinished_requests():
                outs.update((o.request_id, o.outputs[0].token_ids)
                            for o in engine.step() if o.finished)
        if engine is core:   # no step overlapped another while it ran
            assert core.num_overlapped_steps == before
            assert sum("penalties" in r.message for r in caplog.records) == 1
        add(engine, "q", prompts[1], plain)   # then overlapping resumes
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o.outputs[0].token_ids)
                        for o in engine.step() if o.finished)
        if engine is core:
            assert core.num_overlapped_steps > before
            assert outs == want
        want = outs
        assert_no_leaks(engine)


def test_the_flag_is_taken():
    assert EngineConfig(model="m", async_scheduling=True).async_scheduling


def test_a_failed_step_fails_its_requests_only(engines):
    """Step N's collect fails while step N+1 is in flight: N's requests end with an
    error, N+1 is still collected, later requests get their in-order outputs."""
    in_order, core = engines
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    prompts = [[3 + i, 50 + i, 90 + i, 7] for i in range(5)]
    want = {}
    for i, p in enumerate(prompts):
        add(in_order, f"w{i}", p, params)
    while in_order.has_unfinished_requests():
        want.update((o.request_id, o.outputs[0].token_ids)
                    for o in in_order.step() if o.finished)
    real_collect, calls = core.runner.collect, []

    def collect(step):
        calls.append(step)
        if len(calls) == 4:
            raise RuntimeError("injected")
        return real_collect(step)
    core.runner.collect = collect
    got, failed, step = {}, set(), 0
    try:
        while step < 7 or core.has_unfinished_requests():
            if step < 3:
                add(core, f"w{step}", prompts[step], params)
            elif step == 6:   # after the failure
                for i in (3, 4):
                    add(core, f"w{i}", prompts[i], params)
            for o in core.step():
                if o.error is not None:
                    failed.add(o.request_id)
                elif o.finished:
                    got[o.request_id] = o.outputs[0].token_ids
            step += 1
    finally:
        core.runner.collect = real_collect
    assert failed and failed | set(got) == set(want) and {"w3", "w4"} <= set(got)
    assert all(got[r] == want[r] for r in got)
    core.step()
    assert_no_leaks(core)


def test_hybrid_without_prefix_caching(checkpoint):
    """Qwen3.5 (recurrent state slots): a finished request's extra step writes its slot
    before the slot's next owner starts from zeros, in device order; the same tokens as
    in order, under preemption and an abort. (With prefix caching its state snapshots,
    keyed by page hashes, make steps run in order.)"""
    core = LLM(checkpoint("qwen3_5"), enforce_eager=True, async_scheduling=True,
               enable_prefix_caching=False, **SETTINGS).engine
    assert core.async_scheduling
    rng = random.Random(5)
    items = [([rng.randrange(3, 256) for _ in range(rng.randrange(5, 50))],
              SamplingParams(max_tokens=8 + i % 7, ignore_eos=True, temperature=0.0,
                             logprobs=1))
             for i in range(8)]
    runs = {}
    for on in (False, True):
        core.async_scheduling = on   # the same engine, steps in order then overlapped
        before = core.num_overlapped_steps
        runs[on] = _run(core, items, {6: "3"})
        assert (core.num_overlapped_steps > before) == on
        core.step()
        assert_no_leaks(core)
    assert runs[True] == runs[False] and len(runs[True]) == len(items) - 1
    assert core.scheduler.num_preemptions > 0


def test_an_id_reused_while_its_step_is_in_flight(engines):
    """A request aborted while its step is in flight, its id given at once to a new
    request: the in-flight token is never taken for the new one's."""
    in_order, core = engines
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    short, long_ = [9, 8, 7], [20 + i for i in range(12)]
    add(in_order, "x", short, params)
    want = []
    while in_order.has_unfinished_requests():
        want += [o.outputs[0].token_ids for o in in_order.step() if o.finished]
    add(core, "x", long_, params)
    for _ in range(3):
        core.step()
    assert core._in_flight is not None
    core.abort_request("x")
    add(core, "x", short, params)
    got = []
    while core.has_unfinished_requests():
        got += [o.outputs[0].token_ids for o in core.step() if o.finished]
    assert got == want and len(want) == 1
    core.step()
    assert_no_leaks(core)
