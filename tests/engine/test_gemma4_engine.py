"""Gemma 4 in the engine: greedy tokens equal transformers' for every variant under
continuous batching with staggered arrivals and prefill chunks of a 16-token budget
(the sliding window is 8), a preempted request resumes to the same tokens, prefix-cache
hits reproduce the uncached tokens, and nothing leaks."""
from __future__ import annotations

import random

import pytest

from jaxserve import LLM, SamplingParams
from tests.checkpoints import GEMMA4_KINDS, reference_greedy
from tests.engine.conftest import add, assert_no_leaks

NUM_NEW = 24
PROMPT_LENS = (5, 33, 70)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENS]


def _run_staggered(engine, prompts, params=GREEDY, every: int = 2) -> dict[str, list[int]]:
    pending = list(enumerate(prompts))
    results: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i, p = pending.pop(0)
            add(engine, str(i), p, params)
        for o in engine.step():
            if o.finished:
                results[o.request_id] = o.outputs[0].token_ids
        step += 1
    return results


@pytest.fixture(scope="module")
def expected(checkpoint):
    return {kind: reference_greedy(checkpoint(kind), _prompts(), NUM_NEW, kind)
            for kind in GEMMA4_KINDS}


@pytest.mark.parametrize("kind", GEMMA4_KINDS)
def test_greedy_matches_transformers_under_chunked_batching(kind, checkpoint, expected):
    engine = LLM(checkpoint(kind), dtype="float32", max_model_len=160, max_num_seqs=4,
                 max_num_batched_tokens=16).engine
    results = _run_staggered(engine, _prompts())
    assert [results[str(i)] for i in range(len(PROMPT_LENS))] == expected[kind]
    assert_no_leaks(engine)


def test_preemption_resumes_to_the_same_tokens(checkpoint, expected):
    kind = "gemma4_e"
    # 9 pages of 16 tokens for the global layers: the three requests need 13 at their longest.
    engine = LLM(checkpoint(kind), dtype="float32", max_model_len=112, max_num_seqs=4,
                 max_num_batched_tokens=32, num_pages=10).engine
    results = _run_staggered(engine, _prompts(), every=1)
    assert engine.scheduler.num_preemptions > 0
    assert [results[str(i)] for i in range(len(PROMPT_LENS))] == expected[kind]
    assert_no_leaks(engine)


def test_prefix_cache_hit_gives_the_same_tokens(checkpoint, expected):
    kind = "gemma4_kv"
    llm = LLM(checkpoint(kind), dtype="float32", max_model_len=160, max_num_seqs=4,
              max_num_batched_tokens=64, enable_prefix_caching=True)
    prompt = _prompts()[2]                          # 70 tokens: 4 full pages
    first = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == expected[kind][2]
    assert second.num_cached_tokens == 64
    assert second.outputs[0].token_ids == expected[kind][2]
    assert_no_leaks(llm.engine)
