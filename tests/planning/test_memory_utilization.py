"""--gpu-memory-utilization as vLLM means it: the share of the whole device the engine
holds (weights + caches + the programs' temporaries). JAX's GPU pool is sized from it
before JAX starts; the engine's cache budget on a device and the planner's for the same
device are one computation."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxserve.config import EngineConfig
from jaxserve.build import device_pool, gpu_xla_flags
from jaxserve.engine import data_parallel
from jaxserve.build.device_pool import POOL_ENV, set_device_pool
from jaxserve.build.layout import cache_plan_for, layout_for
from jaxserve.build.kv_budget import WORKSPACE_SHARE, cache_budget_bytes
from jaxserve.checkpoints.model_names import load_model_config
from jaxserve.planning.plan import WeightFigures, plan_from_config

GIB = 2**30


class FakeDevice:
    """An accelerator as the engine sees it after loading the weights."""

    def __init__(self, platform: str, bytes_limit: int, bytes_in_use: int):
        self.platform = platform
        self._stats = {"bytes_limit": bytes_limit, "bytes_in_use": bytes_in_use}

    def memory_stats(self) -> dict:
        return self._stats


def test_the_pool_is_set_before_jax_starts(monkeypatch):
    monkeypatch.delenv(POOL_ENV, raising=False)
    monkeypatch.setattr(device_pool, "backends_ready", lambda: False)
    set_device_pool(0.8)
    assert device_pool.os.environ[POOL_ENV] == "0.8"
    monkeypatch.delenv(POOL_ENV)
    set_device_pool(None)   # the accelerators' default
    assert device_pool.os.environ[POOL_ENV] == "0.9"
    # A share the user set, or a JAX that already started, is left alone (and said).
    monkeypatch.setenv(POOL_ENV, "0.5")
    assert "is set" in set_device_pool(0.8) and device_pool.os.environ[POOL_ENV] == "0.5"
    monkeypatch.delenv(POOL_ENV)
    monkeypatch.setattr(device_pool, "backends_ready", lambda: True)
    assert "JAX started before the engine" in set_device_pool(0.8)
    assert POOL_ENV not in device_pool.os.environ


def test_gpu_xla_flags_are_set_before_jax_starts_unless_given(monkeypatch):
    monkeypatch.setattr(gpu_xla_flags, "_cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(gpu_xla_flags, "backends_ready", lambda: False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert "--xla_gpu_enable_triton_gemm=false" in gpu_xla_flags.set_gpu_xla_flags()
    assert gpu_xla_flags.os.environ["XLA_FLAGS"] == \
        "--xla_force_host_platform_device_count=8 --xla_gpu_enable_triton_gemm=false"
    # The user's own value of the flag stays.
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert "has the engine's GPU flags" in gpu_xla_flags.set_gpu_xla_flags()
    assert gpu_xla_flags.os.environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=true"
    # Too late once JAX has started: said, not set.
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(gpu_xla_flags, "backends_ready", lambda: True)
    assert "JAX started before the engine" in gpu_xla_flags.set_gpu_xla_flags()
    assert gpu_xla_flags.os.environ["XLA_FLAGS"] == ""
    # No GPU wanted (JAX_PLATFORMS) or no CUDA plugin: nothing set, nothing said.
    monkeypatch.setattr(gpu_xla_flags, "backends_ready", lambda: False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert gpu_xla_flags.set_gpu_xla_flags() is None
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    monkeypatch.setattr(gpu_xla_flags, "_cuda_plugin_installed", lambda: False)
    assert gpu_xla_flags.set_gpu_xla_flags() is None
    assert gpu_xla_flags.os.environ["XLA_FLAGS"] == ""
    # Quantized weights keep Triton's gemms (their dequantization fuses there).
    monkeypatch.setattr(gpu_xla_flags, "_cuda_plugin_installed", lambda: True)
    assert "keeps its Triton gemms" in gpu_xla_flags.set_gpu_xla_flags(quantized_weights=True)
    assert gpu_xla_flags.os.environ["XLA_FLAGS"] == ""


def test_quantized_weights_from_the_flag_or_the_checkpoint(tmp_path):
    from jaxserve.build.gpu_xla_flags import quantized_weights
    assert quantized_weights("fp8", "llama-3.1-8b")
    assert not quantized_weights(None, "llama-3.1-8b") and not quantized_weights(None, None)
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "fp8"}}')
    assert quantized_weights(None, str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert not quantized_weights(None, str(tmp_path))
    assert not quantized_weights(None, "Org/not-in-any-cache")


def test_make_engine_sizes_the_pool_before_the_mesh(monkeypatch):
    """The server and LLM() build engines through make_engine: the pool comes first."""
    order = []

    class Stop(Exception):
        pass

    def mesh(_):
        order.append("mesh")
        raise Stop
    monkeypatch.setattr(data_parallel, "set_device_pool",
                        lambda share: order.append(("pool", share)) or "")
    monkeypatch.setattr(data_parallel.multihost, "initialize", lambda *a: order.append("dist"))
    monkeypatch.setattr(data_parallel, "make_mesh", mesh)
    with pytest.raises(Stop):
        data_parallel.make_engine(EngineConfig(model="/m", hbm_utilization=0.7))
    assert order == [("pool", 0.7), "dist", "mesh"]


@pytest.mark.parametrize("fraction, utilization, expected_engine", [
    (0.9, 0.9, 0.9 * 80),    # jaxserve set the pool: all of it is the engine's
    (0.75, 0.9, 60),          # JAX started first with its 75 %: the pool caps the share
    (0.95, 0.6, 0.6 * 80)])   # a larger pool the user set: the share is still 60 %
def test_the_budget_is_a_share_of_the_device(monkeypatch, fraction, utilization,
                                             expected_engine):
    """An 80 GiB GPU with 20 GiB of weights: the caches get the engine's share of the
    device less the weights and the reserve, not a share of what the pool leaves."""
    monkeypatch.setenv(POOL_ENV, str(fraction))
    device = FakeDevice("gpu", int(fraction * 80 * GIB), 20 * GIB)
    act = 1 * GIB
    budget, capped = cache_budget_bytes(kv_cache_memory_bytes=None,
                                        hbm_utilization=utilization, activation_bytes=act,
                                        device=device)
    engine = int(expected_engine * GIB)
    reserve = max(act, int(engine * WORKSPACE_SHARE))
    assert not capped and abs(budget - (engine - 20 * GIB - reserve)) <= 64


def test_a_tpu_pool_is_the_chip():
    device = FakeDevice("tpu", 31 * GIB, 10 * GIB)
    budget, _ = cache_budget_bytes(kv_cache_memory_bytes=None, hbm_utilization=0.9,
                                   activation_bytes=0, device=device)
    engine = int(0.9 * 31 * GIB)
    assert budget == engine - 10 * GIB - int(engine * WORKSPACE_SHARE)


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_the_planner_budget_is_the_engines_on_that_device(monkeypatch, spec):
    """qwen3.6-27b (a hybrid) on an 80 GiB GPU whose weights take what the planner counts:
    the engine's cache plan from the device's allocator equals the planner's."""
    monkeypatch.setenv(POOL_ENV, "0.9")
    mc = load_model_config("qwen3.6-27b")
    config = EngineConfig(model="qwen3.6-27b", max_model_len=8192, max_num_seqs=16,
                          speculative_config=spec, compilation_cache_dir=None)
    weights = WeightFigures(27 * 10**9, 54 * 10**9, 40 * GIB, 0)
    plan = plan_from_config(config, mc, hbm_bytes=80 * GIB, weights=weights)
    layout = layout_for(config, mc, "gpu", 1)
    engine = cache_plan_for(config.for_platform("gpu"), layout,
                            FakeDevice("gpu", int(0.9 * 80 * GIB), 40 * GIB))
    assert plan.cache == engine and engine.num_pages > 1
    assert engine.state_slots_per_seq == (2 if spec else 1)
    split = plan.to_json()["memory"]
    assert split["engine_bytes"] == int(0.9 * 80 * GIB)
    assert split["weight_bytes"] + split["reserve_bytes"] + split["kv_page_bytes"] \
        + split["state_slot_bytes"] + split["snapshot_bytes"] + split["unused_bytes"] \
        == split["engine_bytes"]


def test_cpu_keeps_its_meaning():
    """On CPU the share is of the free host RAM (the memory the engine can have there)."""
    from jaxserve.build import kv_budget
    cpu = SimpleNamespace(platform="cpu")
    free = kv_budget.available_host_bytes()
    budget, capped = cache_budget_bytes(kv_cache_memory_bytes=None, hbm_utilization=0.5,
                                        activation_bytes=0, device=cpu)
    assert not capped and abs(budget - free // 2) < free // 10
    _, capped = cache_budget_bytes(kv_cache_memory_bytes=None, hbm_utilization=None,
                                   activation_bytes=0, device=cpu)
    assert capped
