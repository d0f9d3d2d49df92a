"""After warmup, nothing compiles: random requests with every sampling feature, token
constraints and structured outputs included."""
from __future__ import annotations

import random

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.structured_outputs import StructuredOutputsParams as SO
from tests.engine.conftest import assert_no_leaks


# qwen3_5_moe: a hybrid (recurrent-state slots, DeltaNet chunk loops) with a shared-expert
# MoE; a quarter of the requests (its CPU steps cost several times the dense model's, and
# the random features are the same: the first 50 hold each at least 4 times and reach
# every forward program that 100 reach; the sampler's programs are the engine's, not the
# model's, and qwen3_moe's 200 reach more of them than 100 do here); gemma4_e:
# sliding-window and global KV groups, per-layer embeddings and KV-sharing layers.
@pytest.mark.parametrize("kind,num_requests", [("qwen3_moe", 200), ("qwen3_5_moe", 50),
                                               ("gemma4_e", 60)])
def test_random_requests_compile_nothing_new(checkpoint, kind, num_requests):
    llm = LLM(checkpoint(kind), dtype="float32", max_model_len=128, max_num_seqs=16,
              max_num_batched_tokens=64)
    engine = llm.engine
    assert engine.runner.warmup_compilations > 0
    before = engine.num_compilations
    rng = random.Random(0)
    # Random allowed_token_ids keep a first token of each grammar below (else a refusal).
    tok = llm.get_tokenizer()
    firsts = [tok(c, add_special_tokens=False).input_ids[0] for c in "ae{"]
    prompts, params = [], []
    for _ in range(num_requests):
        n = rng.randint(1, 90)
        prompts.append({"prompt_token_ids": [rng.randrange(3, 256) for _ in range(n)]})
        kw = dict(max_tokens=rng.randint(1, 128 - n - 1), ignore_eos=rng.random() < 0.5)
        if rng.random() < 0.6:
            kw.update(temperature=rng.choice([0.5, 1.0, 1.3]), top_p=rng.choice([1.0, 0.8]),
                      top_k=rng.choice([0, 5, 40]), min_p=rng.choice([0.0, 0.05]),
                      seed=rng.choice([None, rng.randrange(1000)]))
        else:
            kw.update(temperature=0.0)
        if rng.random() < 0.2:
            kw.update(n=rng.randint(2, 3), temperature=1.0)
        if rng.random() < 0.2:
            kw.update(logprobs=rng.randint(0, 5))
        if rng.random() < 0.1:
            kw.update(prompt_logprobs=rng.randint(0, 3))
        if rng.random() < 0.2:
            kw.update(stop=["e", "ab"], include_stop_str_in_output=rng.random() < 0.5)
        if rng.random() < 0.2:
            kw.update(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.5)
        if rng.random() < 0.1:
            kw.update(stop_token_ids=[rng.randrange(3, 256)], min_tokens=min(2, kw["max_tokens"]))
        if rng.random() < 0.1:    # a grammar's mask and the fixed token constraints
            kw.update(ignore_eos=False, min_tokens=0, structured_outputs=rng.choice(
                [SO(choice=["ab", "e"]), SO(regex="[a-f]{1,9}"), SO(json_object=True)]))
        if rng.random() < 0.1:
            kw.update(logit_bias={rng.randrange(3, 256): rng.uniform(-5, 5)},
                      allowed_token_ids=rng.sample(range(3, 256), 30) + firsts)
        params.append(SamplingParams(**kw))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == num_requests and all(o.finished for o in outs)
    assert all(len(o.outputs) == p.n for o, p in zip(outs, params))
    assert engine.num_compilations == before, "something compiled after warmup"
    assert_no_leaks(engine)
