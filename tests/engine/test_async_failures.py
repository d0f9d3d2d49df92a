"""The server's AsyncEngine, driven in-process from asyncio: a failed request raises
RequestFailedError for its caller only and the engine goes on; anything the engine
cannot survive fails every caller with EngineDeadError, marks the engine dead and
calls on_fatal once."""
from __future__ import annotations

import asyncio

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from tests.engine.conftest import assert_no_leaks
from tests.engine.test_step_failure import (BUDGET, FILLS_A_STEP, GREEDY, OTHER,
                                            overflowing_params)


def build(checkpoint) -> LLM:
    # (no warmup: as test_step_failure's engines; `expected` compiles the clean run first)
    return LLM(checkpoint("llama"), dtype="float32", max_model_len=64, max_num_seqs=4,
               max_num_batched_tokens=BUDGET, enforce_eager=True)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return build(checkpoint)


@pytest.fixture(scope="module")
def expected(llm):
    out = llm.generate({"prompt_token_ids": OTHER}, GREEDY, use_tqdm=False)[0]
    return out.outputs[0].token_ids


@pytest.fixture
def engine(llm):
    """An AsyncEngine on the module's core; fatal errors are recorded, not acted on."""
    fatal: list[BaseException] = []
    llm.reset_prefix_cache()
    eng = AsyncEngine(llm.engine.info.config, core=llm.engine, on_fatal=fatal.append)
    eng.fatal = fatal
    yield eng
    eng.shutdown()


async def tokens(engine: AsyncEngine, rid: str, prompt: list[int], params) -> list[int]:
    """The request's tokens; a caller left waiting by a silently dead engine thread
    fails the test (TimeoutError) instead of hanging it."""
    async def collect() -> list[int]:
        got = []
        async for out in engine.generate(engine.inputs.process(rid, prompt, params)):
            got += out.outputs[0].token_ids if out.outputs else []
        return got
    return await asyncio.wait_for(collect(), timeout=60)


def test_failed_request_raises_and_the_engine_goes_on(engine, llm, expected):
    async def run():
        # "bad" is added first and fills its step; "good" waits, so it is not in it.
        return await asyncio.gather(tokens(engine, "bad", FILLS_A_STEP, overflowing_params()),
                                    tokens(engine, "good", OTHER, GREEDY),
                                    return_exceptions=True)
    bad, good = asyncio.run(run())
    assert isinstance(bad, RequestFailedError), bad
    assert bad.request_id == "bad" and bad.error.startswith("OverflowError")
    assert "'bad' failed: OverflowError" in str(bad)
    assert good == expected
    assert asyncio.run(tokens(engine, "later", OTHER, GREEDY)) == expected
    assert not engine.dead and engine.fatal == []
    engine.shutdown()
    assert_no_leaks(llm.engine)


def test_add_that_raises_fails_only_that_request(engine, llm, expected, monkeypatch):
    """The scheduler refuses the second completion of an n=2 request with something
    other than a ValueError: the caller gets RequestFailedError, nothing of the
    request stays behind, the engine serves on."""
    core = llm.engine
    real_add = core.scheduler.add_request

    def add_request(request):
        if request.request_id == "1_pair":
            raise KeyError("injected")
        real_add(request)
    monkeypatch.setattr(core.scheduler, "add_request", add_request)
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4)
    with pytest.raises(RequestFailedError, match="'pair' failed: KeyError"):
        asyncio.run(tokens(engine, "pair", OTHER, params))
    assert not core.outputs.has("pair")
    assert core.scheduler.get_request("0_pair") is None
    assert asyncio.run(tokens(engine, "after", OTHER, GREEDY)) == expected
    assert not engine.dead and engine.fatal == []
    engine.shutdown()
    assert_no_leaks(core)


def test_shutdown_engine_is_dead_and_refuses_work(engine):
    assert not engine.dead
    engine.shutdown()
    assert engine.dead
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(tokens(engine, "x", OTHER, GREEDY))
    assert engine.fatal == []


def test_statistics_failure_is_fatal(engine, llm, monkeypatch):
    """An error outside any step (here the statistics snapshot) must not end the
    thread silently."""
    def stats():
        raise RuntimeError("stats broke")
    monkeypatch.setattr(llm.engine, "stats", stats)
    engine.abort("nobody")          # wakes the idle loop, which then publishes stats
    engine._thread.join(10)
    assert engine.dead
    assert [str(e) for e in engine.fatal] == ["stats broke"]
    with pytest.raises(EngineDeadError, match="RuntimeError: stats broke"):
        asyncio.run(tokens(engine, "x", OTHER, GREEDY))


def test_lost_device_state_is_fatal(checkpoint):
    """The forward pass took the donated KV cache with it: every caller gets
    EngineDeadError, on_fatal runs once, the engine is dead, new requests are refused
    at once."""
    core = build(checkpoint).engine
    fatal: list[BaseException] = []
    engine = AsyncEngine(core.info.config, core=core, on_fatal=fatal.append)
    real_dispatch = core.runner.dispatch

    def dispatch(sched_out):
        if "doomed" in sched_out.req_ids:
            core.runner.kv_caches["kv"].delete()   # as if donated into a call that raised
            raise RuntimeError("inside the forward pass")
        return real_dispatch(sched_out)
    core.runner.dispatch = dispatch

    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def run():   # "a" is still decoding when "doomed" fails its step
        return await asyncio.gather(
            tokens(engine, "a", OTHER, long),
            tokens(engine, "doomed", FILLS_A_STEP, GREEDY),
            tokens(engine, "waiting", OTHER, long), return_exceptions=True)
    try:
        results = asyncio.run(run())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "KV cache" in str(results[0])
        engine._thread.join(10)
        assert engine.dead and not engine._thread.is_alive()
        assert len(fatal) == 1 and isinstance(fatal[0], EngineDeadError)
        assert "inside the forward pass" in str(fatal[0])
        with pytest.raises(EngineDeadError):
            asyncio.run(tokens(engine, "new", OTHER, GREEDY))
        assert len(fatal) == 1
    finally:
        engine.shutdown()
