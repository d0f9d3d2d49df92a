"""Qwen3.5 hybrids in the engine: greedy tokens equal transformers' alone, with
prefills chunked by a small token budget, and under continuous batching with staggered
arrivals; recurrent-state slots are handed out with the first pages and come back on
finish, abort and preemption, and a preempted request resumes to the same tokens.
Numerics only: the engines skip warmup (enforce_eager; test_no_recompile.py checks a
hybrid's warmup)."""
from __future__ import annotations

import random

import pytest

from jaxserve import LLM, SamplingParams
from tests.checkpoints import HYBRID_KINDS, reference_greedy
from tests.engine.conftest import add, assert_no_leaks, run_staggered

NUM_NEW = 32
PROMPT_LENS = (5, 33, 70, 130)   # 70 and 130 tokens: several DeltaNet chunks of 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENS]




@pytest.fixture(scope="module")
def expected(checkpoint):
    return {kind: reference_greedy(checkpoint(kind), _prompts(), NUM_NEW, kind) for kind in HYBRID_KINDS}


@pytest.fixture(scope="module")
def single_prefill(checkpoint):
    """kind -> an engine whose 256-token budget takes every prompt in one prefill, built
    once for the module (the parity test and the slot test share qwen3_5's)."""
    made: dict[str, LLM] = {}

    def get(kind: str) -> LLM:
        if kind not in made:
            made[kind] = LLM(checkpoint(kind), dtype="float32", max_model_len=256,
                             max_num_seqs=4, max_num_batched_tokens=256,
                             enable_prefix_caching=False, enforce_eager=True)
        return made[kind]
    return get


@pytest.fixture(scope="module")
def small_budget(checkpoint):
    """kind -> an engine with a 32-token budget and 14 pages of 16 tokens (the four
    requests need 24 at their longest), built once for the module (the parity test's
    staggered run and the preemption test share qwen3_5's)."""
    made: dict[str, LLM] = {}

    def get(kind: str) -> LLM:
        if kind not in made:
            made[kind] = LLM(checkpoint(kind), dtype="float32", max_model_len=176,
                             max_num_seqs=4, max_num_batched_tokens=32, num_pages=15,
                             enforce_eager=True)
        return made[kind]
    return get


@pytest.mark.parametrize("kind", HYBRID_KINDS)
def test_greedy_matches_transformers(kind, expected, single_prefill, small_budget):
    prompts, want = _prompts(), expected[kind]
    # One at a time, each prompt in a single prefill.
    llm = single_prefill(kind)
    for p, w in zip(prompts, want):
        assert llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == w
    assert_no_leaks(llm.engine)
    # Together, arriving at different steps, with a 32-token budget: prefills continue
    # across steps from the slot's state and share steps with other requests' decodes.
    engine = small_budget(kind).engine
    results = run_staggered(engine, prompts, GREEDY, every=3)
    assert [results[str(i)] for i in range(len(prompts))] == want
    assert_no_leaks(engine)


def test_preemption_resumes_to_the_same_tokens(expected, small_budget):
    kind = "qwen3_5"
    prompts, want = _prompts(), expected[kind]
    llm = small_budget(kind)   # 14 pages: all four at once need 24
    llm.reset_prefix_cache()   # (no hits on the parity test's pages)
    engine = llm.engine
    before = engine.scheduler.num_preemptions
    results = run_staggered(engine, prompts, GREEDY, every=1)
    assert engine.scheduler.num_preemptions > before
    assert [results[str(i)] for i in range(len(prompts))] == want
    assert_no_leaks(engine)


def test_state_slots_come_back_on_abort_and_n_greater_than_one(expected, single_prefill):
    kind = "qwen3_5"
    prompts, want = _prompts(), expected[kind]
    llm = single_prefill(kind)
    engine, kv = llm.engine, llm.engine.scheduler.kv
    add(engine, "a", prompts[3], GREEDY)
    add(engine, "b", prompts[2], GREEDY)
    engine.step()
    slots = {kv.get_state_slot("a"), kv.get_state_slot("b")}
    assert len(slots) == 2 and 0 not in slots and kv.state_slots.num_free == 2
    engine.abort_request("a")
    engine.step()
    assert kv.state_slots.num_free == 3
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)
    # n=2 greedy on the same engine: both completions computed in full, each from its own
    # state slot (no shared prompt pages on a hybrid).
    assert llm.reset_prefix_cache()
    out = llm.generate(
        {"prompt_token_ids": prompts[2]}, SamplingParams(n=2, temperature=0.0, max_tokens=NUM_NEW,
                                                          ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [want[2], want[2]]
