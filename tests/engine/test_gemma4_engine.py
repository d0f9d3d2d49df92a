"""Gemma 4 in the engine: greedy tokens equal transformers' for every variant under
continuous batching with staggered arrivals and prefill chunks of a 16-token budget
(the sliding window is 8), a preempted request resumes to the same tokens, prefix-cache
hits reproduce the uncached tokens, and nothing leaks. Numerics only: the engines skip
warmup (enforce_eager; test_no_recompile.py checks gemma4_e's warmup)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from pallas_kernels.held_dtypes import value_dtype
from tests.checkpoints import GEMMA4_KINDS, reference_greedy
from tests.engine.conftest import add, assert_no_leaks, run_staggered

NUM_NEW = 24
PROMPT_LENS = (5, 33, 70)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def expected(checkpoint):
    return {kind: reference_greedy(checkpoint(kind), _prompts(), NUM_NEW, kind)
            for kind in GEMMA4_KINDS}


@pytest.fixture(scope="module")
def chunked(checkpoint):
    """kind -> an engine with a 16-token step budget, built once for this module."""
    made: dict[str, LLM] = {}

    def get(kind: str) -> LLM:
        if kind not in made:
            made[kind] = LLM(checkpoint(kind), dtype="float32", max_model_len=160,
                             max_num_seqs=4, max_num_batched_tokens=16, enforce_eager=True)
        return made[kind]
    return get


@pytest.mark.parametrize("kind", GEMMA4_KINDS)
def test_greedy_matches_transformers_under_chunked_batching(kind, chunked, expected):
    engine = chunked(kind).engine
    results = run_staggered(engine, _prompts(), GREEDY, every=2)
    assert [results[str(i)] for i in range(len(PROMPT_LENS))] == expected[kind]
    assert_no_leaks(engine)


def test_preemption_resumes_to_the_same_tokens(checkpoint, expected):
    kind = "gemma4_e"
    # 9 pages of 16 tokens for the global layers: the three requests need 13 at their longest.
    engine = LLM(checkpoint(kind), dtype="float32", max_model_len=112, max_num_seqs=4,
                 max_num_batched_tokens=32, num_pages=10, enforce_eager=True).engine
    results = run_staggered(engine, _prompts(), GREEDY, every=1)
    assert engine.scheduler.num_preemptions > 0
    assert [results[str(i)] for i in range(len(PROMPT_LENS))] == expected[kind]
    assert_no_leaks(engine)


def test_prefix_cache_hit_gives_the_same_tokens(chunked, expected):
    """On the batching test's engine (prefix caching is on by default): its programs
    are compiled already, and its 16-token chunks make the hit cover several."""
    kind = "gemma4_kv"
    llm = chunked(kind)
    assert llm.engine.prefix_caching
    llm.reset_prefix_cache()     # (the batching test ran this prompt): computed afresh
    prompt = _prompts()[2]                          # 70 tokens: 4 full pages
    first = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == expected[kind][2]
    assert second.num_cached_tokens == 64
    assert second.outputs[0].token_ids == expected[kind][2]
    assert_no_leaks(llm.engine)


def test_fp8_weights_and_kv_as_the_vllm_guide(checkpoint):
    """--quantization fp8 --kv-cache-dtype fp8 --enable-prefix-caching: both KV groups
    stored in fp8 (a scale per group's layer and KV head), every linear layer and expert
    in fp8; a prefix hit reads the fp8 pages another request wrote and gives the tokens
    of the cold run. (Logits against dequantized weights: tests/models/
    test_parity_gemma4.py; agreement with the float engine is not tested here: the
    tiny random Gemma's attention, scale 1 on unit-RMS q and k, is so sharp that even a
    bfloat16 cache changes a quarter of its top-1 tokens.) int8 KV and measured fp8 scales
    start, with scales of their own per KV group."""
    path = checkpoint("gemma4_moe")
    llm = LLM(path, dtype="float32", max_model_len=160, max_num_seqs=4,
              max_num_batched_tokens=64, quantization="fp8", kv_cache_dtype="fp8",
              enable_prefix_caching=True, enforce_eager=True)
    caches = llm.engine.runner.kv_caches
    # (held as their bits on CPU: pallas_kernels/held_dtypes.py)
    assert {value_dtype(c.dtype).name for c in caches.values()} == {"float8_e4m3fn"}
    assert len(caches) == 2
    prompt = {"prompt_token_ids": _prompts()[2]}
    cold = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    warm = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 64
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert_no_leaks(llm.engine)
    # int8 and measured fp8 scales: each KV group calibrated on its own (the scales'
    # accuracy: tests/models/test_kv_scales.py; no warmup: only the start is checked).
    for kv, calculate in (("int8", False), ("fp8", True)):
        llm = LLM(path, dtype="float32", max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=64, kv_cache_dtype=kv, calculate_kv_scales=calculate,
                  enforce_eager=True)
        for name in ("kv_scales", "kv_scales_sliding"):
            s = np.asarray(llm.engine.runner.params[name])
            assert (s > 0).all() and len(np.unique(s)) == s.size, (kv, name)


def test_pages_leaving_the_window_go_back_to_the_pool(chunked, expected):
    """A long generation holds at most the window's sliding pages (window 8 over pages of
    16: the page being written and the one before), while the global layers keep every
    page; the tokens are still transformers'."""
    from jaxserve.core.kv_cache_manager import SLIDING, window_pages
    kind = "gemma4"
    llm = chunked(kind)
    llm.reset_prefix_cache()     # (the batching test ran this prompt): computed afresh
    engine = llm.engine
    assert_no_leaks(engine)
    kv = engine.scheduler.kv
    sliding_total = kv.get_num_free_pages(SLIDING)
    prompt = _prompts()[2]                                   # 70 tokens
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    add(engine, "long", prompt, params)
    most_held = most_global = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                tokens = o.outputs[0].token_ids
        if engine.has_unfinished_requests():
            held = [p for p in kv.get_page_ids("long", SLIDING) if p != 0]
            most_held = max(most_held, len(held))
            most_global = max(most_global, len(kv.get_page_ids("long")))
            assert kv.get_num_free_pages(SLIDING) == sliding_total - len(held)
    assert tokens[:NUM_NEW] == expected[kind][2]
    assert most_global == -(-(70 + 80 - 1) // 16)           # every page of the sequence
    assert most_held <= window_pages(8, 16) + 1 < most_global  # + the step's next page
    assert kv.get_num_free_pages(SLIDING) == sliding_total
    assert_no_leaks(engine)
