"""One front door for LLM: every prompt is checked once, by the engine's input
processor, and the engine trusts what it gets; the engine is an Engine (the
protocol) whose facts are one frozen EngineInfo."""
from __future__ import annotations

import dataclasses

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.engine_core import EngineCore
from jaxserve.engine.protocol import Engine, EngineInfo
from models.weights import param_bytes
from tests.engine.conftest import assert_no_leaks

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("llama"), dtype="float32", max_model_len=64, max_num_seqs=4,
               max_num_batched_tokens=32)


def counts(llm: LLM) -> tuple[int, int]:
    inputs = llm.engine.inputs
    return inputs.num_processed, inputs.num_refused


def test_generate_checks_each_prompt_exactly_once(llm):
    before = counts(llm)
    prompts = ["Hello there", {"prompt_token_ids": [5, 6, 7]}, {"prompt": "Hi"}]
    outs = llm.generate(prompts, SamplingParams(n=2, seed=1, max_tokens=3), use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2, 2, 2]
    assert counts(llm) == (before[0] + 3, before[1])   # per prompt, not per completion
    llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert counts(llm) == (before[0] + 4, before[1])


def test_a_refused_prompt_is_counted_once_and_adds_nothing(llm):
    before = counts(llm)
    with pytest.raises(ValueError, match="must not be empty") as e:
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": []}], GREEDY,
                     use_tqdm=False)
    assert e.value.param == "prompt"
    # The first prompt passed the door; neither reached the engine.
    assert counts(llm) == (before[0] + 1, before[1] + 1)
    assert not llm.engine.has_unfinished_requests()
    assert_no_leaks(llm.engine)


def test_the_engine_adds_without_checking_again(llm, monkeypatch):
    """add_request takes the processed request as it is: the processor is not asked."""
    engine = llm.engine
    request = engine.inputs.process("trusted", [5, 6, 7], GREEDY)

    def no_second_check(*args, **kwargs):
        raise AssertionError("the engine validated an already processed request")
    monkeypatch.setattr(engine.inputs, "process", no_second_check)
    engine.add_request(request)
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[-1].request_id == "trusted" and len(outs[-1].outputs[0].token_ids) == 3
    assert_no_leaks(engine)


def test_engine_core_is_an_engine_with_frozen_info(llm):
    core = llm.engine
    assert isinstance(core, EngineCore) and isinstance(core, Engine)
    info = core.info
    assert isinstance(info, EngineInfo)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.num_pages = 0   # type: ignore[misc]
    assert (info.max_model_len, info.dtype, info.num_replicas) == (64, "float32", 1)
    assert info.num_pages == core.scheduler.kv.num_pages
    assert info.vocab_size == core.model_config.vocab_size
    assert info.kv_tokens == (core.scheduler.kv.num_pages - 1) * info.page_size
    assert info.weight_bytes == param_bytes(core.params) > 0
    assert info.warmup_compilations == core.runner.warmup_compilations > 0
    assert info.warmup_seconds == core.runner.warmup_seconds
    assert info.config is core.config
