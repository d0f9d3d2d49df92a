"""max_tokens=0: score a prompt (its prompt logprobs) without sampling anything, as
lm-eval's loglikelihood requests do through the server."""
from __future__ import annotations

import random

import pytest

from jaxserve import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks


@pytest.fixture(scope="module")
def llm(checkpoint):
    # Outputs only: no warmup, the programs greedy requests use compile when first run.
    return LLM(checkpoint("qwen3"), dtype="float32", max_model_len=160, max_num_seqs=8,
               max_num_batched_tokens=64, page_size=16, enforce_eager=True)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


def _logprobs(entries) -> list[float | None]:
    return [None if e is None else e[tok].logprob for tok, e in entries]


def test_max_tokens_0_scores_the_prompt_and_samples_nothing(llm):
    # 100 tokens: the prompt spans two 64-token steps (chunked prefill).
    prompts = [{"prompt_token_ids": _ids(n, seed=n)} for n in (9, 100, 33)]
    scored = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=2),
                          use_tqdm=False)
    # The reference: the same prompts with one sampled token (the usual path).
    ref = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2),
                       use_tqdm=False)
    for s, r in zip(scored, ref):
        ids = s.prompt_token_ids
        assert s.finished and len(s.outputs) == 1
        out = s.outputs[0]
        assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
        assert len(s.prompt_logprobs) == len(ids) and s.prompt_logprobs[0] is None
        got = _logprobs(zip(ids, s.prompt_logprobs))
        want = _logprobs(zip(ids, r.prompt_logprobs))
        assert got[0] is None and all(g is not None for g in got[1:])
        assert got == pytest.approx(want, abs=1e-6)
        # the top-2 alternatives are there too
        assert all(len(e) >= 2 for e in s.prompt_logprobs[1:])
    assert_no_leaks(llm.engine)


def test_max_tokens_0_costs_only_the_prompt_and_mixes_with_generation(llm):
    engine = llm.engine
    prompt = {"prompt_token_ids": _ids(40, seed=5)}
    before = engine.num_scheduled_tokens
    llm.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)
    assert engine.num_scheduled_tokens - before == 40     # no decode step
    # In one batch with generating requests, n > 1, and without prompt logprobs.
    outs = llm.generate(
        [prompt, prompt, {"prompt_token_ids": _ids(20, seed=6)}],
        [SamplingParams(max_tokens=0, n=2, prompt_logprobs=1),
         SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
         SamplingParams(max_tokens=0)], use_tqdm=False)
    assert [c.token_ids for c in outs[0].outputs] == [[], []]
    assert len(outs[1].outputs[0].token_ids) == 6
    assert outs[2].outputs[0].token_ids == [] and outs[2].prompt_logprobs is None
    assert all(c.finish_reason == "length" for o in outs for c in o.outputs)
    assert_no_leaks(engine)


def test_negative_max_tokens_is_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=0, min_tokens=1)
