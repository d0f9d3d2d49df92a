"""The data-parallel engine (mesh 2x1 on simulated CPU devices) behind the one front
door: each prompt is checked once, before routing, and no replica checks it again;
it is an Engine whose EngineInfo is replica 0's with the warmup summed."""
from __future__ import annotations

import asyncio

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.data_parallel import DataParallelEngine
from jaxserve.engine.protocol import Engine
from tests.engine.conftest import assert_no_leaks

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("llama"), dtype="float32", mesh="2x1", max_model_len=64,
               max_num_seqs=4, max_num_batched_tokens=32)


def test_each_prompt_is_checked_once_before_routing(llm, monkeypatch):
    engine = llm.engine
    assert isinstance(engine, DataParallelEngine) and isinstance(engine, Engine)
    # Replicas share the front door's limits but never check: a replica asked to
    # would fail the test.
    for r in engine.replicas[1:]:
        monkeypatch.setattr(r, "inputs", None)
    inputs = engine.inputs
    before = inputs.num_processed
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(n=2, seed=2, max_tokens=3), use_tqdm=False)
    assert all(len(o.outputs) == 2 for o in outs)
    assert inputs.num_processed == before + 4
    assert all(r.num_steps > 0 for r in engine.replicas)   # both replicas served
    for r in engine.replicas:
        assert_no_leaks(r)


def test_add_request_trusts_the_processed_request(llm, monkeypatch):
    engine = llm.engine
    request = engine.inputs.process("trusted", [5, 6, 7], GREEDY)

    def no_second_check(*args, **kwargs):
        raise AssertionError("validated twice")
    monkeypatch.setattr(engine.inputs, "process", no_second_check)
    engine.add_request(request)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(request)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(final["trusted"].outputs[0].token_ids) == 3


def test_info_is_replica_zeros_with_the_warmup_summed(llm):
    engine = llm.engine
    info, first = engine.info, engine.replicas[0].info
    assert info.num_replicas == 2 and first.num_replicas == 1
    assert info.num_pages == first.num_pages == engine.replicas[0].scheduler.kv.num_pages  # per replica
    assert info.weight_bytes == first.weight_bytes                             # per replica
    assert info.max_model_len == 64 and info.dtype == "float32"
    assert info.warmup_compilations == sum(r.info.warmup_compilations for r in engine.replicas)
    assert info.warmup_seconds == pytest.approx(sum(r.info.warmup_seconds
                                                    for r in engine.replicas))


def test_the_async_engine_offers_the_front_door_and_info(llm):
    engine = AsyncEngine(llm.engine.info.config, core=llm.engine)
    try:
        assert engine.info is llm.engine.info and engine.inputs is llm.engine.inputs
        before = engine.inputs.num_processed

        async def run() -> list[int]:
            got: list[int] = []
            async for out in engine.generate(engine.inputs.process("a", [5, 6], GREEDY)):
                got += out.outputs[0].token_ids
            return got
        assert len(asyncio.run(run())) == 3
        assert engine.inputs.num_processed == before + 1
    finally:
        engine.shutdown()
