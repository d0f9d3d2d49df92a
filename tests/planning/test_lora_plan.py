"""The planner counts the LoRA slots (--enable-lora --max-loras N --max-lora-rank R): the
stacks' bytes per device are what the engine's runner allocates on a 1x2 mesh, and they
come out of the KV cache's share of the device; and the dtype --lora-dtype auto gives them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxserve.build.layout import build_layout_model, engine_layout
from jaxserve.build.parts import lora_store
from jaxserve.config import EngineConfig
from jaxserve.planning.plan import make_plan
from jaxserve.planning.plan_format import format_plan
from models.config import ModelConfig
from sharding import make_mesh
from tests.checkpoints import make_tiny_checkpoint

ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)


def test_lora_slots_are_counted_as_the_runner_allocates_them(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "llama")
    mc = ModelConfig.from_pretrained(path)
    lora = dict(enable_lora=True, max_loras=3, max_lora_rank=8)
    config = EngineConfig(model=path, mesh="1x2", **ENGINE, **lora)
    mesh = make_mesh("1x2", jax.devices()[:2])
    layout = engine_layout(config.for_platform("cpu"), mc, mesh)
    store = lora_store(config, layout, build_layout_model(layout))
    stacks = store.init_stacks(mesh)
    on_device0 = sum(s.data.nbytes for leaf in jax.tree_util.tree_leaves(stacks)
                     for s in leaf.addressable_shards if s.device == jax.devices()[0])
    hbm = 1 << 30
    base = make_plan(mc, model=path, mesh="1x2", hbm_bytes=hbm, **ENGINE)
    plan = make_plan(mc, model=path, mesh="1x2", hbm_bytes=hbm, **ENGINE, **lora)
    assert plan.lora_bytes_per_device == on_device0 > 0
    assert base.kv_budget_bytes - plan.kv_budget_bytes == on_device0
    assert base.lora is None and "LoRA: 3 adapter slot(s)" in format_plan(plan)
    assert jnp.dtype(store.config.dtype) == jnp.float32


@pytest.mark.parametrize("native_bf16_dot", [True, False])
def test_auto_lora_dtype_is_the_projections_dot_dtype(tmp_path, monkeypatch, native_bf16_dot):
    """--lora-dtype auto on CPU for a bfloat16 checkpoint: bf16 stacks where the CPU
    multiplies bf16 natively (the projections' dots take bf16 there, and so does the
    all-slots pass: models/lora/ops._cpu_add), float32 where every weight is upcast; an
    explicit --lora-dtype wins either way."""
    import torch

    import models.registry
    monkeypatch.setattr(models.registry, "cpu_has_bf16_dot", lambda: native_bf16_dot)
    path = make_tiny_checkpoint("llama", tmp_path / "llama", dtype=torch.bfloat16)
    mc = ModelConfig.from_pretrained(path)
    mesh = make_mesh("1x1", jax.devices()[:1])

    def stacks_dtype(**kw):
        config = EngineConfig(model=path, dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                              enable_lora=True, max_loras=2, max_lora_rank=8, **kw)
        layout = engine_layout(config.for_platform("cpu"), mc, mesh)
        return jnp.dtype(lora_store(config, layout, build_layout_model(layout)).config.dtype)

    assert stacks_dtype() == (jnp.bfloat16 if native_bf16_dot else jnp.float32)
    assert stacks_dtype(lora_dtype="float32") == jnp.float32
    assert stacks_dtype(lora_dtype="bfloat16") == jnp.bfloat16
