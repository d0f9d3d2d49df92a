"""Every attention / matmul implementation is chosen at start-up and named per layer
group; a combination no kernel takes is refused with the fix or a logged fallback, never
a silent one. layout_for takes the platform as a string, so a GPU or TPU engine's
choices are checked here, on a CPU, from the published configs (no weights)."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

from jaxserve.config import EngineConfig
from jaxserve.build.layout import layout_for
from jaxserve.checkpoints.model_names import load_model_config
from pallas_kernels.ragged_paged_attention import dispatch


def layout(model: str, platform: str, **kw):
    config = EngineConfig(model=model, load_format="dummy", max_model_len=4096, **kw)
    return layout_for(config, load_model_config(model), platform, 1)


def lines(lay) -> list[str]:
    return [k.describe() for k in lay.kernels]


def test_float32_cache_on_a_gpu_runs_the_xla_page_loop_and_says_why():
    """"auto" with a float32 cache on a GPU: the Mosaic kernel reads 16-bit and quantized
    caches only, and the dispatcher would run the slow jnp reference without a word."""
    lay = layout("llama-3.1-8b", "gpu", dtype="float32")
    assert lay.attention_backend == "xla"
    attention = lay.kernels[0]
    assert attention.fallback and attention.impl == "xla page loop" and attention.layers == 32
    assert lines(lay)[0].startswith("attention: xla page loop for 32 layers (full, head_dim "
                                    "128, 8 KV heads, float32 cache); fallback from pallas-gpu")
    assert "float32" in attention.note


def test_float32_cache_with_the_kernel_asked_for_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"attention_backend=pallas: .*float32.*Use "
                                         r"attention_backend='xla'.*bfloat16"):
        layout("llama-3.1-8b", "gpu", dtype="float32", attention_backend="pallas")


@pytest.mark.parametrize("platform, impl, backend", [
    ("gpu", "pallas-gpu", "pallas"), ("cuda", "pallas-gpu", "pallas"),
    ("tpu", "pallas-tpu", "pallas"), ("cpu", "xla page loop", "xla")])
def test_each_platform_names_its_attention_path(platform, impl, backend):
    lay = layout("llama-3.1-8b", platform, dtype="bfloat16")
    assert lay.attention_backend == backend
    assert lines(lay)[0].startswith(f"attention: {impl} for 32 layers (full, head_dim 128")
    assert not lay.kernels[0].fallback
    assert lines(lay)[-1].startswith("matmul: xla dot for 32 layers (bfloat16 weights")


def test_pallas_asked_for_on_a_cpu_is_a_logged_fallback():
    lay = layout("llama-3.1-8b", "cpu", attention_backend="pallas")
    assert lay.kernels[0].fallback and lay.kernels[0].impl == "jnp reference"
    assert "no Pallas attention kernel for cpu" in lines(lay)[0]


def test_gemma4_layer_groups_and_its_fp8_global_layers():
    lay = layout("gemma-4-31b", "gpu")
    assert lines(lay)[:2] == [
        "attention: pallas-gpu for 50 layers (sliding 1024, head_dim 256, 16 KV heads, "
        "bfloat16 cache)",
        "attention: pallas-gpu for 10 layers (full, head_dim 512, 4 KV heads, bfloat16 cache)"]
    # The global layers' head_dim 512 takes no fp8 cache on a GPU: refused at start-up...
    with pytest.raises(ValueError, match="kv_cache_dtype=float8_e4m3fn: .*head_dim 512"):
        layout("gemma-4-31b", "gpu", kv_cache_dtype="fp8")
    # ...while the memory planner, which does not start an engine, says so in the choice.
    config = EngineConfig(model="gemma-4-31b", load_format="dummy", max_model_len=4096,
                          kv_cache_dtype="fp8")
    planned = layout_for(config, load_model_config("gemma-4-31b"), "gpu", 1,
                         check_kernels=False)
    assert "the engine refuses this" in planned.kernels[0].note


def test_hybrid_names_its_linear_attention_and_quantized_matmuls():
    lay = layout("qwen3.6-27b", "gpu", quantization="fp8")
    assert lines(lay) == [
        "attention: pallas-gpu for 16 layers (full, head_dim 256, 4 KV heads, bfloat16 cache)",
        "linear attention: pallas-gpu for 48 layers (decode step, Dk 128, Dv 128; prefill "
        "chunks: the jnp chunked loop)",
        "matmul: xla dot for 64 layers (float8_e4m3fn weights with per-channel scales, "
        "dequantized into a bfloat16 dot (w8a16))"]
    cpu = layout("qwen3.6-27b", "cpu", attention_backend="pallas")
    assert cpu.kernels[1].fallback and "no Pallas decode-step kernel for cpu" in lines(cpu)[1]


def test_dispatcher_traced_on_a_gpu_logs_its_reference_fallback(monkeypatch, caplog):
    """The kernel-level fallback (float32 cache, impl="pallas") is logged where the
    program is traced for a GPU (faked: the CPU runs the reference branch)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q = jnp.ones((2, 2, 64), jnp.float32)
    cache = jnp.zeros((3, 2, 16, 64), jnp.float32)   # [pages, 2K, S, H], one KV head
    args = (q, cache, jnp.array([2], jnp.int32), jnp.array([[1]], jnp.int32),
            jnp.array([0, 2], jnp.int32), jnp.array([1], jnp.int32))
    with caplog.at_level(logging.WARNING, logger=dispatch.logger.name):
        dispatch.ragged_paged_attention(*args, sm_scale=1.0, impl="pallas")
    assert any("runs the jnp reference" in r.getMessage() and "float32" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=dispatch.logger.name):
        dispatch.ragged_paged_attention(q.astype(jnp.bfloat16), cache.astype(jnp.bfloat16),
                                        *args[2:], sm_scale=1.0, impl="xla")
    assert not caplog.records
