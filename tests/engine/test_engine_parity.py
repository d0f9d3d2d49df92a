"""Greedy generation equals transformers' generate(do_sample=False) on the same file,
one prompt at a time and under continuous batching with chunked prefill. Numerics only:
the engines skip warmup (enforce_eager) and compile what greedy requests use
(test_no_recompile.py and test_warmup_budget.py check warmup)."""
from __future__ import annotations

import random

import pytest

from jaxserve import LLM, SamplingParams
from tests.checkpoints import reference_greedy
from tests.engine.conftest import KINDS, add, assert_no_leaks

NUM_NEW = 32
PROMPT_LENS = (5, 16, 33, 70)   # 70 tokens = more than 3 pages of 16


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENS]


def _reference(path: str, prompts: list[list[int]]) -> list[list[int]]:
    return reference_greedy(path, prompts, NUM_NEW)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(kind, checkpoint):
    path = checkpoint(kind)
    prompts = _prompts()
    expected = _reference(path, prompts)

    # One at a time, with a budget that holds every prompt in a single step.
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=128, enforce_eager=True)
    for p, want in zip(prompts, expected):
        out = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == "length"
    assert_no_leaks(llm.engine)

    # All together, arriving at different steps, with a 32-token budget: prefills are
    # chunked and share steps with other requests' decodes.
    engine = LLM(path, dtype="float32", max_model_len=128, max_num_seqs=4,
                 max_num_batched_tokens=32, enable_prefix_caching=False,
                 enforce_eager=True).engine
    pending = list(enumerate(prompts))
    results: dict[str, list[int]] = {}
    step = 0
    chunked = mixed = False
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            i, p = pending.pop(0)
            add(engine, str(i), p, GREEDY)
        sched_before = engine.scheduler
        outs = engine.step()
        step += 1
        for o in outs:
            if o.finished:
                results[o.request_id] = o.outputs[0].token_ids
        # Record that the batches really mixed chunked prefills with decodes.
        running = sched_before.running
        chunked |= any(0 < r.num_computed_tokens < r.num_prompt_tokens for r in running)
        mixed |= (any(r.num_output_tokens > 0 for r in running)
                  and any(r.num_computed_tokens < r.num_prompt_tokens for r in running))
    assert chunked and mixed
    assert [results[str(i)] for i in range(len(prompts))] == expected
    assert_no_leaks(engine)
