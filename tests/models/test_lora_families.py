"""Every family's LoRA targets match the transformers model's linear layers (what PEFT
can adapt), and the Qwen3.5 DeltaNet's regrouped in_proj_qkv gets peft's delta."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from models.config import ModelConfig
from models.layer_stack import layer_period
from models.lora.adapter import load_peft_adapter
from models.lora.ops import SPLIT_IN, SPLIT_OUT, group_by_slot, lora_delta
from models.lora.slots import SCALES, init_stacks, slot_weights, target_stacks, write_slot
from models.lora.targets import adapter_weights, lora_targets
from models.registry import build_model
from models.weights import load_params
from tests.checkpoints import make_tiny_checkpoint, make_tiny_model, model_class

# Decoder linears transformers has that jaxserve keeps elsewhere: none. jaxserve's own
# Einsum kernels that transformers does not make nn.Linear: Qwen3-MoE's router.
_ONLY_OURS = {"qwen3_moe": {"gate"}, "qwen3_5_moe": {"gate"}}


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "qwen3_5_moe", "gemma4_e", "gemma4_moe"])
def test_targets_are_the_decoder_linears(kind):
    hf = make_tiny_model(kind)
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    targets = lora_targets(build_model(cfg, jnp.float32), cfg)
    prefix = "model.language_model." if cfg.is_hybrid else "model."
    linears = {n[len(prefix):]: m for n, m in hf.named_modules()
               if isinstance(m, torch.nn.Linear) and n.startswith(prefix + "layers.")}
    assert linears.keys() <= targets.keys(), sorted(linears.keys() - targets.keys())[:5]
    extra = {targets[n].module for n in targets.keys() - linears.keys()}
    assert extra == _ONLY_OURS.get(kind, set())
    for name, m in linears.items():   # sizes as PEFT's lora_A [r, in] / lora_B [out, r]
        t = targets[name]
        assert (t.in_dim, t.out_dim) == (m.in_features, m.out_features), name
    assert not any(".experts." in n for n in targets)
    ups = [t.split for t in targets.values() if t.module in ("q_proj", "up_proj", "in_proj_qkv")]
    downs = [t.split for t in targets.values() if t.module in ("o_proj", "down_proj", "out_proj")]
    assert set(ups) == {SPLIT_OUT} and set(downs) == {SPLIT_IN}
    # A scanned model (layers stacked per period position) has the same targets; only
    # where their stacks sit differs: a block's slice of the scanned kernels' stack.
    scanned = lora_targets(build_model(cfg, jnp.float32, scan_layers=True), cfg)
    strip = lambda ts: {k: dataclasses.replace(t, path=(), index=()) for k, t in ts.items()}
    assert strip(scanned) == strip(targets)
    last = list(targets)[-1]
    assert scanned[last].index == (targets[last].layer // layer_period(cfg),)


def test_deltanet_in_proj_qkv_parity(tmp_path):
    """The base kernel regroups in_proj_qkv's output channels per key head; the adapter's
    B must follow. The column order is read off the loaded base kernel itself."""
    path = make_tiny_checkpoint("qwen3_5", tmp_path / "q35")
    cfg = ModelConfig.from_pretrained(path)
    model = build_model(cfg, jnp.float32)
    targets = lora_targets(model, cfg)
    torch.manual_seed(3)
    base = model_class("qwen3_5").from_pretrained(path, dtype=torch.float32)   # the VL model
    peft_model = get_peft_model(base, LoraConfig(
        r=4, lora_alpha=4, use_rslora=True, init_lora_weights=False,
        target_modules=r".*language_model.*\.(in_proj_qkv|out_proj|in_proj_z)"))
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    adapter = load_peft_adapter(tmp_path / "adapter")
    stacks = init_stacks(targets, max_loras=1, max_rank=4, dtype=jnp.float32)
    stacks = write_slot(stacks, jnp.int32(1), slot_weights(
        adapter_weights(adapter, targets, cfg, max_rank=4), adapter.scaling, targets, 4, np.float32))
    name = "layers.0.linear_attn.in_proj_qkv"
    kernel = np.asarray(load_params(path, cfg, model, jnp.float32)["layers_0"]["linear_attn"]
                        ["in_proj_qkv"]["kernel"]).reshape(cfg.hidden_size, -1)
    layer = peft_model.get_submodule(f"base_model.model.model.language_model.{name}")
    w = layer.base_layer.weight.detach().numpy()                  # [out, E], HF order
    perm = [int(np.argmin(np.abs(w - col[None, :]).sum(1))) for col in kernel.T]
    np.testing.assert_array_equal(kernel, w.T[:, perm])           # a true permutation
    assert sorted(perm) == list(range(w.shape[0])) and perm != sorted(perm)

    slots = np.array([1, 0, 1, 1, 0], np.int32)
    x = np.random.default_rng(0).standard_normal((5, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        want = layer(torch.from_numpy(x)).numpy()[:, perm]
    want[slots == 0] = (x @ kernel)[slots == 0]
    got = x @ kernel + lora_delta(jnp.asarray(x), group_by_slot(jnp.asarray(slots), 2),
                                  *target_stacks(stacks, targets[name]), stacks[SCALES])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want - x @ kernel)[slots == 1].max() > 1e-3
