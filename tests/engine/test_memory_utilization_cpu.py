"""--gpu-memory-utilization (hbm_utilization) and --kv-cache-memory-bytes on CPU: the KV
cache gets that share of the free RAM, or those bytes; without either, a quarter of the
free RAM, only as much as max_num_seqs sequences need. The cache is sized before warmup,
so the engines skip it (enforce_eager): a request still runs on the cache they sized."""
from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.build import kv_budget

FREE_RAM = 64 << 20   # what the test says the host has free


@pytest.fixture
def small_host(monkeypatch):
    monkeypatch.setattr(kv_budget, "available_host_bytes", lambda: FREE_RAM)


def kv_bytes(llm: LLM) -> int:
    return llm.engine.info.cache_plan.kv_bytes


def run_one(llm: LLM) -> None:
    out = llm.generate("hello there", SamplingParams(max_tokens=4, temperature=0.0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("share", [0.5])
def test_gpu_memory_utilization_is_a_share_of_free_ram(checkpoint, small_host, share):
    llm = LLM(checkpoint("llama"), gpu_memory_utilization=share, max_model_len=64,
              max_num_seqs=4, compilation_cache_dir=None, enforce_eager=True)
    plan = llm.engine.info.cache_plan
    assert llm.engine.config.hbm_utilization == share
    # Every whole page of the share, and no more.
    assert share * FREE_RAM - plan.bytes_per_page < kv_bytes(llm) <= share * FREE_RAM
    run_one(llm)


def test_default_takes_only_what_the_sequences_need(checkpoint, small_host):
    llm = LLM(checkpoint("llama"), max_model_len=64, max_num_seqs=4,
              compilation_cache_dir=None, enforce_eager=True)
    assert llm.engine.config.hbm_utilization is None
    plan = llm.engine.info.cache_plan
    assert kv_bytes(llm) < FREE_RAM // 4   # capped at the demand, far below the share
    assert plan.kv_tokens >= 4 * 64


def test_kv_cache_memory_bytes(checkpoint, small_host):
    llm = LLM(checkpoint("llama"), kv_cache_memory_bytes=3 << 20, max_model_len=64,
              max_num_seqs=4, compilation_cache_dir=None, enforce_eager=True)
    assert (3 << 20) - llm.engine.info.cache_plan.bytes_per_page < kv_bytes(llm) <= 3 << 20
    run_one(llm)
