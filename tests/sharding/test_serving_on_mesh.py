"""One warmed-up 2x4 engine (two tensor-parallel replicas of a MoE model whose 2 KV
heads are replicated over 4 devices): nothing compiles after warmup, the compiled
step has only the all-reduces tensor parallelism needs, and the async engine (the
server's) runs on the data-parallel front door."""
from __future__ import annotations

import asyncio
import random

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.runner.sampling_tensors import make_sampling_tensors
from pallas_kernels.ragged_paged_attention import KV_CACHE_NDIM, KV_HEAD_AXIS
from sharding import kv_cache_sharding
from tests.engine.conftest import assert_no_leaks
from tests.sharding.conftest import assert_step_collectives, collectives


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("qwen3_moe"), dtype="float32", mesh="2x4", max_model_len=128,
               max_num_seqs=4, max_num_batched_tokens=32)


def _random_requests(n: int, seed: int = 0):
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        k = rng.randint(1, 80)
        prompts.append({"prompt_token_ids": [rng.randrange(3, 256) for _ in range(k)]})
        kw = dict(max_tokens=rng.randint(1, 127 - k), ignore_eos=True)
        if rng.random() < 0.6:
            kw.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.8]),
                      top_k=rng.choice([0, 5]), seed=rng.randrange(1000))
        else:
            kw.update(temperature=0.0)
        if rng.random() < 0.2:
            kw.update(n=2, temperature=1.0)
        if rng.random() < 0.3:
            kw.update(logprobs=rng.randint(0, 3))
        if rng.random() < 0.15:
            kw.update(prompt_logprobs=1)
        if rng.random() < 0.2:
            kw.update(repetition_penalty=1.2, presence_penalty=0.5)
        params.append(SamplingParams(**kw))
    return prompts, params


def test_nothing_compiles_after_warmup(llm):
    engine = llm.engine
    assert all(r.runner.warmup_compilations > 0 for r in engine.replicas)
    before = engine.num_compilations
    prompts, params = _random_requests(40)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finished for o in outs)
    assert engine.num_compilations == before, "something compiled after warmup"
    for core in engine.replicas:
        assert core.num_steps > 0
        want = kv_cache_sharding(core.mesh, KV_HEAD_AXIS, KV_CACHE_NDIM)
        assert core.runner.kv_caches["kv"].sharding == want
        assert_no_leaks(core)


def test_step_has_only_the_tensor_parallel_collectives(llm):
    core = llm.engine.replicas[1]
    runner, mc = core.runner, core.model_config
    rows = runner.batch.max_num_seqs
    assert_step_collectives(core)   # MoE: the all-reduce comes after the top-k combine

    # Sampling gathers the vocab-parallel logits [R, V] (in the branches of sampled rows
    # and of logprobs), never the [V, E] weights.
    tensors = make_sampling_tensors([], rows, mc.vocab_size, penalty_len=runner.max_model_len)
    hidden_rows = jax.device_put(np.zeros((rows, mc.hidden_size), np.float32), runner._rep)
    with jax.set_mesh(runner.mesh):
        hlo = runner._sample.lower(runner.params, hidden_rows, tensors, rows,
                                   "random").compile().as_text()
    gathers = [shape.split("{")[0] for shape, kind in collectives(hlo) if kind == "all-gather"]
    assert gathers and set(gathers) == {f"f32[{rows},{mc.vocab_size}]"}, gathers


def test_async_engine_serves_through_the_front_door(llm):
    prompts, _ = _random_requests(6, seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids
                for o in llm.generate(prompts, greedy, use_tqdm=False)]
    engine = AsyncEngine(llm.engine.info.config, core=llm.engine)

    async def one(i, p):
        last = None
        request = engine.inputs.process(f"a{i}", p["prompt_token_ids"], greedy)
        async for out in engine.generate(request):
            last = out
        return last.outputs[0].token_ids

    async def run():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    try:
        got = asyncio.run(run())
    finally:
        engine.shutdown()
    assert got == expected
    assert engine.stats.num_running == 0
    assert all(core.num_unfinished() == 0 for core in llm.engine.replicas)


def test_front_door_routes_to_the_cached_prefix(llm):
    engine = llm.engine
    rng = random.Random(7)
    a, b = ([rng.randrange(3, 256) for _ in range(40)] for _ in range(2))
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    # Both idle: a goes to replica 0, b to the then less loaded replica 1.
    llm.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}], greedy, use_tqdm=False)
    hits = [core.stats().prefix_cache_hits for core in engine.replicas]
    # Idle again (a tie on load): b's continuation follows its cached pages to replica 1.
    llm.generate({"prompt_token_ids": b + [9, 9]}, greedy, use_tqdm=False)
    gained = [core.stats().prefix_cache_hits - h for core, h in zip(engine.replicas, hits)]
    assert gained[0] == 0 and gained[1] == 32      # two full pages of 16


def test_plan_for_the_running_engine(llm):
    from jaxserve.planning.plan import plan_for_engine
    text = plan_for_engine(llm.engine.info)   # its config, model_config, dtype, max_model_len
    assert "mesh 2x4 (2 replicas x 4-way tensor parallel)" in text
    assert "KV heads                   2 do not divide by 4: each replicated 2x, 1 per device" \
        in text
