"""The runner's persistent batch in a whole engine: under random arrivals, aborts, a
failed step and a KV pool small enough to force preemption, every request gets the
tokens (and logprobs) it gets run alone, whatever rows the batch held around it:
penalties (the runner's own output history), prompt logprobs, logprobs, n > 1,
min_tokens, seeded sampling, prefix hits at admission and chunked prefill; a hybrid
(Qwen3.5) model too. After every step the runner holds exactly the scheduler's
running requests (and those finished since the last schedule, dropped at the next)."""
from __future__ import annotations

import random

import pytest

from jaxserve import LLM, SamplingParams
from tests.engine.conftest import add, assert_no_leaks, prompt_workload

PREFIX_LEN = 20   # more than one page of 16: later requests hit it in the prefix cache


def _params(i: int) -> SamplingParams:
    base = dict(max_tokens=12 + 3 * (i % 5), ignore_eos=True, temperature=0.0)
    kinds = [
        {},
        {"repetition_penalty": 1.5, "presence_penalty": 0.8, "frequency_penalty": 0.3},
        {"logprobs": 2, "prompt_logprobs": 2},
        {"n": 2},
        {"temperature": 0.9, "top_p": 0.9, "seed": 1234 + i},
        {"min_tokens": 6, "stop_token_ids": [7, 9], "ignore_eos": False},
    ]
    return SamplingParams(**{**base, **kinds[i % len(kinds)]})


def _workload(seed: int, num: int) -> list[tuple[list[int], SamplingParams]]:
    return prompt_workload(seed, num, _params, PREFIX_LEN, max_tail=30)


def _summary(out) -> tuple:
    """What must not depend on the batch: tokens, and logprobs rounded."""
    comps = tuple(tuple(c.token_ids) for c in out.outputs)
    lps = tuple(tuple(round(d[t].logprob, 3) for d, t in zip(c.logprobs, c.token_ids))
                for c in out.outputs if c.logprobs is not None)
    prompt = tuple(None if d is None else round(max(x.logprob for x in d.values()), 3)
                   for d in out.prompt_logprobs or ())
    return comps, lps, prompt


def _check_rows(core) -> None:
    held = set(core.runner.batch.row_of)
    running = {r.request_id for r in core.scheduler.running}
    assert running <= held <= running | set(core.scheduler._finished_ids)


def _run_alone(core, items) -> list[tuple]:
    want = []
    for i, (prompt, params) in enumerate(items):
        add(core, f"alone{i}", prompt, params)
        outs = []
        while core.has_unfinished_requests():
            outs += [o for o in core.step() if o.finished]
        want.append(_summary(outs[0]))
    return want


def _run_mixed(core, items, seed: int, fail_step: int) -> tuple[dict, set, set]:
    """Random arrivals and aborts; the step number `fail_step` fails in collect."""
    rng = random.Random(seed)
    pending = list(enumerate(items))
    got, aborted, failed = {}, set(), set()
    real_collect = core.runner.collect
    steps = 0

    def collect(step):
        if steps == fail_step:
            raise RuntimeError("injected")
        return real_collect(step)
    core.runner.collect = collect
    try:
        while pending or core.has_unfinished_requests():
            while pending and rng.random() < 0.4:
                i, (prompt, params) = pending.pop(0)
                add(core, str(i), prompt, params)
            running = [r.request_id for r in core.scheduler.running]
            if running and rng.random() < 0.05:
                rid = rng.choice(running).split("_")[-1]   # a parent id ("1_3" -> "3")
                if core.abort_request(rid) is not None:
                    aborted.add(int(rid))
            for o in core.step():
                if o.error is not None:
                    failed.add(int(o.request_id))
                elif o.finished:
                    got[int(o.request_id)] = _summary(o)
            _check_rows(core)
            steps += 1
    finally:
        core.runner.collect = real_collect
    return got, aborted, failed


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_persistent_batch_matches_requests_run_alone(kind, checkpoint):
    llm = LLM(checkpoint(kind), dtype="float32", max_model_len=96, max_num_seqs=4,
              max_num_batched_tokens=32, num_pages=9)
    core = llm.engine
    items = _workload(seed=3, num=14)
    want = _run_alone(core, items)
    core.reset_prefix_cache()
    hits = core.stats().prefix_cache_hits
    got, aborted, failed = _run_mixed(core, items, seed=5, fail_step=40)
    for i, summary in got.items():
        assert summary == want[i], (i, items[i][1])
    assert set(got) | aborted | failed == set(range(len(items)))
    assert len(got) >= len(items) // 2
    assert core.scheduler.num_preemptions > 0 and failed
    if core.prefix_caching:
        assert core.stats().prefix_cache_hits > hits
    core.step()   # the last finished ids reach the runner
    assert core.runner.batch.num_rows == 0 and not core.runner.batch.page_table.any()
    assert_no_leaks(core)
