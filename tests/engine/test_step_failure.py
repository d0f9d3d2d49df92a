"""A step that raises fails only its own requests; the engine serves on.

The failure is injected for real: a top_k of 2**40 slips past SamplingParams'
validation (object.__setattr__) and the runner's int32 sampling tensors overflow.
The budget is 32 tokens, so a 32-token prompt (none of it cached) fills a step on its
own and a request added after it waits: it is not in the failing step and must be
unharmed.
"""
from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.core.outputs import RequestOutput
from jaxserve.errors import EngineDeadError, RequestFailedError
from tests.engine.conftest import add, assert_no_leaks

BUDGET = 32
FILLS_A_STEP = list(range(3, 3 + BUDGET))     # two full pages of 16
OTHER = [7, 8, 9, 10, 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def overflowing_params(max_tokens: int = 6) -> SamplingParams:
    """Greedy, but top_k too large for int32 (the front door will refuse it; here it
    reaches the runner). A seed, so the engine never re-validates it via replace()."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0, ignore_eos=True)
    object.__setattr__(params, "top_k", 2**40)
    return params


@pytest.fixture(scope="module")
def llm(checkpoint):
    # No warmup (every engine here): the failures are the runner's, not the compiler's.
    return LLM(checkpoint("llama"), dtype="float32", max_model_len=64, max_num_seqs=4,
               max_num_batched_tokens=BUDGET, enforce_eager=True)


@pytest.fixture(scope="module")
def expected(llm):
    """Greedy tokens of a clean run, per prompt."""
    outs = llm.generate([{"prompt_token_ids": p} for p in (FILLS_A_STEP, OTHER)], GREEDY,
                        use_tqdm=False)
    return {tuple(p): o.outputs[0].token_ids for p, o in zip((FILLS_A_STEP, OTHER), outs)}


def run_to_end(engine) -> dict[str, RequestOutput]:
    """Steps until idle (a bounded number: a request stuck by a broken recovery must
    fail the test, not hang it); the final output of each request."""
    final = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final, "two final outputs"
                final[out.request_id] = out
    raise AssertionError(f"still unfinished after 200 steps; finished: {sorted(final)}")


def test_failed_step_fails_only_its_requests(llm, expected):
    core = llm.engine
    llm.reset_prefix_cache()                           # so the prompt fills the step
    add(core, "bad", FILLS_A_STEP, overflowing_params())
    add(core, "good", OTHER, GREEDY)           # waits: the step is full
    final = run_to_end(core)
    bad = final["bad"]
    assert bad.finished and bad.error.startswith("OverflowError: ")
    assert "int32" in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["abort"] and not bad.outputs[0].token_ids
    assert final["good"].error is None
    assert final["good"].outputs[0].token_ids == expected[tuple(OTHER)]
    assert_no_leaks(core)
    # The engine serves the next request as if nothing had happened.
    add(core, "next", FILLS_A_STEP, GREEDY)
    assert run_to_end(core)["next"].outputs[0].token_ids == expected[tuple(FILLS_A_STEP)]
    assert_no_leaks(core)


def test_all_n_completions_fail_and_every_page_comes_back(llm, monkeypatch):
    """A failure mid-decode (collect raises on the third step): both completions of the
    n=2 request end, with the tokens they had, and all their pages are free."""
    core = llm.engine
    real_collect, calls = core.runner.collect, []

    def collect(step):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real_collect(step)
    monkeypatch.setattr(core.runner, "collect", collect)
    add(core, "pair", OTHER, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=9))
    final = run_to_end(core)
    assert final["pair"].error == "RuntimeError: injected"
    assert [len(c.token_ids) for c in final["pair"].outputs] == [2, 2]
    assert {c.finish_reason for c in final["pair"].outputs} == {"abort"}
    assert_no_leaks(core)


def test_completion_id_taken_by_another_request_is_refused_harmlessly(llm, expected):
    """Completion 0 of an n=2 request "dup" is named "0_dup": a running request of that
    name must keep its outputs when the add is refused."""
    core = llm.engine
    add(core, "0_dup", OTHER, GREEDY)
    with pytest.raises(ValueError, match="'0_dup' is already in use"):
        add(core, "dup", OTHER, SamplingParams(n=2, seed=1, max_tokens=3))
    assert not core.outputs.has("dup")
    assert run_to_end(core)["0_dup"].outputs[0].token_ids == expected[tuple(OTHER)]
    assert_no_leaks(core)


def test_update_failing_after_a_request_finished_leaves_nothing_running(llm, expected,
                                                                         monkeypatch):
    """The scheduler's update finishes "short" (max_tokens=1), then raises on "long"
    (its sampled token went missing): "short" must not stay in the running list."""
    core = llm.engine
    real_collect = core.runner.collect

    def collect(step):
        out = real_collect(step)
        out.sampled.pop("long", None)
        return out
    monkeypatch.setattr(core.runner, "collect", collect)
    add(core, "short", OTHER, SamplingParams(temperature=0.0, max_tokens=1))
    add(core, "long", [12, 13, 14], GREEDY)
    final = run_to_end(core)
    assert "no sampled token" in final["long"].error
    assert final["short"].error is not None    # in the failed step: it fails with it
    monkeypatch.undo()
    assert core.scheduler.running == []
    add(core, "next", OTHER, GREEDY)
    assert run_to_end(core)["next"].outputs[0].token_ids == expected[tuple(OTHER)]
    assert_no_leaks(core)


@pytest.mark.parametrize("sharer", [False, True])
def test_pages_the_failed_step_did_not_write_leave_the_prefix_cache(llm, expected, sharer,
                                                                     monkeypatch):
    """The step fails before its forward pass, after its full pages were offered to the
    prefix cache: a later request with the same prompt must not reuse them. sharer: a
    second request of the same step took the first page as a prefix hit."""
    core = llm.engine
    prompt = FILLS_A_STEP[:20] if sharer else FILLS_A_STEP
    clean = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    llm.reset_prefix_cache()
    real_dispatch = core.runner.dispatch

    def dispatch(sched_out):
        if "unwritten" in sched_out.req_ids:
            raise RuntimeError("before the forward pass")
        return real_dispatch(sched_out)
    monkeypatch.setattr(core.runner, "dispatch", dispatch)
    add(core, "unwritten", prompt, GREEDY)
    hits = core.stats().prefix_cache_hits
    if sharer:
        add(core, "sharer", prompt[:16] + [50, 51], GREEDY)
    failed = run_to_end(core)
    assert "before the forward pass" in failed["unwritten"].error
    if sharer:   # it hit the first page in the failing step itself
        assert core.stats().prefix_cache_hits - hits == 16 and failed["sharer"].error
    monkeypatch.undo()
    add(core, "again", prompt, GREEDY)
    again = run_to_end(core)["again"]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == clean.outputs[0].token_ids
    assert_no_leaks(core)


def test_llm_generate_raises_and_stays_usable(llm, expected):
    llm.reset_prefix_cache()
    with pytest.raises(RuntimeError, match=r"request '\d+' failed: OverflowError") as info:
        llm.generate([{"prompt_token_ids": FILLS_A_STEP}, {"prompt_token_ids": OTHER}],
                     [overflowing_params(), GREEDY], use_tqdm=False)
    assert isinstance(info.value, RequestFailedError)
    assert_no_leaks(llm.engine)
    outs = llm.generate([{"prompt_token_ids": OTHER}, {"prompt_token_ids": FILLS_A_STEP}],
                        GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [expected[tuple(OTHER)],
                                                      expected[tuple(FILLS_A_STEP)]]
    assert_no_leaks(llm.engine)


def test_lost_device_state_is_fatal(checkpoint):
    """A failure that took the donated KV cache with it cannot be survived."""
    llm = LLM(checkpoint("llama"), dtype="float32", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=BUDGET, enforce_eager=True)
    core = llm.engine
    assert core.runner.device_state_ok()

    def dispatch(sched_out):
        core.runner.kv_caches["kv"].delete()    # as if donated into a call that then raised
        raise RuntimeError("inside the forward pass")
    core.runner.dispatch = dispatch
    add(core, "r", OTHER, GREEDY)
    with pytest.raises(EngineDeadError, match="KV cache .* was lost.*inside the forward"):
        core.step()
    assert not core.runner.device_state_ok()


@pytest.fixture(scope="module")
def dp_llm(checkpoint):
    return LLM(checkpoint("llama"), dtype="float32", mesh="2x1", max_model_len=64,
               max_num_seqs=4, max_num_batched_tokens=BUDGET, enforce_eager=True)


@pytest.mark.parametrize("where", ["dispatch", "collect"])
def test_one_replica_fails_the_other_finishes(dp_llm, where, monkeypatch):
    """mesh 2x1: replica 0's step fails (while dispatching, or while collecting after
    replica 1 dispatched); replica 1's requests finish with a clean run's tokens."""
    llm = dp_llm
    engine = llm.engine
    clean = llm.generate({"prompt_token_ids": OTHER}, GREEDY, use_tqdm=False)[0]
    if where == "collect":
        r0 = engine.replicas[0].runner

        def collect(step):
            raise RuntimeError("replica 0 collect")
        monkeypatch.setattr(r0, "collect", collect)
    params = overflowing_params() if where == "dispatch" else GREEDY
    llm.reset_prefix_cache()
    add(engine, "bad", FILLS_A_STEP, params)      # idle: replica 0
    add(engine, "good", OTHER, GREEDY)            # less loaded: replica 1
    assert engine._replica_of == {"bad": 0, "good": 1}
    final = run_to_end(engine)
    assert final["bad"].error is not None
    assert final["good"].error is None
    assert final["good"].outputs[0].token_ids == clean.outputs[0].token_ids
    monkeypatch.undo()
    for core in engine.replicas:
        assert_no_leaks(core)
    assert engine._replica_of == {}
    assert llm.generate({"prompt_token_ids": OTHER}, GREEDY,
                        use_tqdm=False)[0].outputs[0].token_ids == clean.outputs[0].token_ids
