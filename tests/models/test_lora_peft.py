"""PEFT adapters read by jaxserve (models/lora): the tiny llama's targets, two adapters
written with peft stacked in device slots, and each projection's base output plus the
batched delta equal to peft's module output, per token, for a batch mixing adapters."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from models.config import ModelConfig
from models.lora.adapter import load_peft_adapter
from models.lora.ops import SPLIT_IN, SPLIT_OUT, group_by_slot, lora_delta
from models.lora.slots import (SCALES, clear_slot, init_stacks, slot_weights, target_stacks,
                               write_slot)
from models.lora.targets import adapter_weights, lora_targets
from models.registry import build_model
from tests.checkpoints import make_tiny_checkpoint

MAX_RANK = 8
# Two adapters: different ranks and targets, the second rsLoRA over every linear layer.
ADAPTERS = {
    "a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    "b": dict(r=4, lora_alpha=8, use_rslora=True, target_modules="all-linear"),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("lora") / "llama")
    cfg = ModelConfig.from_pretrained(path)
    return path, cfg, lora_targets(build_model(cfg, jnp.float32), cfg)


@pytest.fixture(scope="module")
def peft_dirs(llama, tmp_path_factory):
    path = llama[0]
    dirs = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        # init_lora_weights=False: random B too, so every delta is non-zero.
        peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **kw))
        dirs[name] = str(tmp_path_factory.mktemp("adapters") / name)
        peft_model.save_pretrained(dirs[name])
    return dirs


def test_llama_targets(llama):
    _, cfg, targets = llama
    assert {t.module for t in targets.values()} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert len(targets) == 7 * cfg.num_layers
    q, o = targets["layers.1.self_attn.q_proj"], targets["layers.1.self_attn.o_proj"]
    n, h, e = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    assert (q.in_dim, q.out_dim, q.split, q.layer) == (e, n * h, SPLIT_OUT, 1)
    assert (o.in_dim, o.out_dim, o.split) == (n * h, e, SPLIT_IN)
    assert targets["layers.0.mlp.down_proj"].split == SPLIT_IN


def test_peft_config_read(peft_dirs):
    a, b = load_peft_adapter(peft_dirs["a"]), load_peft_adapter(peft_dirs["b"])
    assert (a.rank, a.scaling, a.use_rslora) == (8, 2.0, False)
    assert (b.rank, b.use_rslora) == (4, True) and b.scaling == pytest.approx(8 / 2)
    assert set(a.target_modules) == {"q_proj", "v_proj", "o_proj", "down_proj"}
    assert "model.layers.1.self_attn.o_proj" in a.tensors
    # peft names b's few (14) targets in full: the engine matches them by module name
    assert "model.layers.0.mlp.up_proj" in b.target_modules
    assert b.base_model.endswith("llama")


@pytest.fixture(scope="module")
def mixed(llama, peft_dirs):
    """Adapter a in slot 1, b in slot 3, slot 2 empty; peft's model with both loaded."""
    path, cfg, targets = llama
    stacks = init_stacks(targets, max_loras=3, max_rank=MAX_RANK, dtype=jnp.float32)
    for slot, name in ((1, "a"), (3, "b")):
        adapter = load_peft_adapter(peft_dirs[name])
        weights = adapter_weights(adapter, targets, cfg, max_rank=MAX_RANK, base_model=path)
        stacks = write_slot(stacks, jnp.int32(slot),
                            slot_weights(weights, adapter.scaling, targets, MAX_RANK, np.float32))
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), peft_dirs["a"],
        adapter_name="a").eval()
    peft_model.load_adapter(peft_dirs["b"], adapter_name="b")
    return stacks, peft_model


@pytest.mark.parametrize("module", ["layers.1.self_attn.q_proj", "layers.0.self_attn.o_proj",
                                    "layers.1.mlp.down_proj", "layers.0.mlp.gate_proj"])
def test_linear_parity_with_peft_mixed_slots(llama, mixed, module):
    """x @ W + the grouped delta from the slots == peft's module output with each token's
    adapter active (slot 0: the base module), float32, 1e-5."""
    _, _, targets = llama
    stacks, peft_model = mixed
    target = targets[module]
    slots = np.array([3, 0, 1, 1, 3, 2, 0, 1, 3, 3, 0], np.int32)
    x = np.random.default_rng(1).standard_normal((len(slots), target.in_dim)).astype(np.float32)
    layer = peft_model.get_submodule(f"base_model.model.model.{module}")
    with torch.no_grad():
        xt = torch.from_numpy(x)
        per_slot = {0: layer.base_layer(xt)}
        for slot, name in ((1, "a"), (3, "b")):
            peft_model.set_adapter(name)
            per_slot[slot] = layer(xt)
        w = layer.base_layer.weight.numpy()
    want = np.stack([per_slot.get(s, per_slot[0])[i].numpy() for i, s in enumerate(slots)])

    got = x @ w.T + lora_delta(jnp.asarray(x), group_by_slot(jnp.asarray(slots), 4),
                               *target_stacks(stacks, targets[module]), stacks[SCALES])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    adapted = {1: module.rsplit(".", 1)[1] in ADAPTERS["a"]["target_modules"], 3: True}
    for slot, on in adapted.items():   # the adapters really changed what they target
        rows = slots == slot
        assert np.abs(want[rows] - x[rows] @ w.T).max() > 1e-3 if on else \
            np.allclose(want[rows], x[rows] @ w.T, rtol=1e-5, atol=1e-5)


def test_write_and_clear_slot_in_place(llama, peft_dirs):
    path, cfg, targets = llama
    adapter = load_peft_adapter(peft_dirs["b"])
    one = slot_weights(adapter_weights(adapter, targets, cfg, max_rank=MAX_RANK), adapter.scaling,
                       targets, MAX_RANK, np.float32)
    stacks = init_stacks(targets, 2, MAX_RANK, jnp.float32)
    old_leaf = stacks["layers_0"]["self_attn"]["q_proj"]["a"]
    stacks = write_slot(stacks, jnp.int32(2), one)
    assert old_leaf.is_deleted(), "the stacks are donated (updated in place)"
    q = stacks["layers_0"]["self_attn"]["q_proj"]
    np.testing.assert_array_equal(q["a"][2], one["layers_0"]["self_attn"]["q_proj"]["a"])
    assert not np.any(q["a"][:2]) and float(stacks[SCALES][2]) == pytest.approx(4.0)
    assert not np.any(q["a"][2][adapter.rank:]), "rank 4 padded to 8 with zeros ([r, in] rows)"
    stacks = clear_slot(stacks, jnp.int32(2))
    assert not any(np.any(x) for x in jax.tree_util.tree_leaves(stacks))
    # In place: the compiled writer's outputs are its donated inputs, no stack copied.
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), stacks)
    ones = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.float32), one)
    mem = write_slot.lower(shapes, jax.ShapeDtypeStruct((), jnp.int32), ones).compile().memory_analysis()
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(stacks))
    assert mem.alias_size_in_bytes >= 0.99 * total and mem.temp_size_in_bytes < total // 100


# ---- refusals, each naming its cause (adapters written by hand: small and fast) --------

def _write_adapter(path, tensors: dict[str, tuple[int, ...]], **config) -> str:
    import json

    from safetensors.numpy import save_file
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
           "base_model_name_or_path": "", **config}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({f"base_model.model.{name}": np.ones(shape, np.float32)
               for name, shape in tensors.items()}, str(path / "adapter_model.safetensors"))
    return str(path)


def _q(layer: int = 0, r: int = 4, e: int = 64, out: int = 64) -> dict[str, tuple[int, ...]]:
    m = f"model.layers.{layer}.self_attn.q_proj"
    return {f"{m}.lora_A.weight": (r, e), f"{m}.lora_B.weight": (out, r)}


@pytest.mark.parametrize("kind, make, message", [
    ("rank", lambda p: _write_adapter(p, _q(r=16), r=16), "rank 16 is above --max-lora-rank 8"),
    ("module", lambda p: _write_adapter(p, _q(), target_modules=["q_proj", "c_attn"]),
     r"target module\(s\) c_attn not in the model"),
    ("base", lambda p: _write_adapter(p, _q(), base_model_name_or_path="org/other-model"),
     "trained on 'org/other-model', not on the served model"),
    ("shape", lambda p: _write_adapter(p, _q(e=128)), "maps 128 -> 64 features, the model's 64 -> 64"),
    ("layer", lambda p: _write_adapter(p, _q(layer=9)), "'model.layers.9.self_attn.q_proj' is not a LoRA target"),
    ("experts", lambda p: _write_adapter(p, {
        "model.layers.0.mlp.experts.3.gate_proj.lora_A.weight": (4, 64),
        "model.layers.0.mlp.experts.3.gate_proj.lora_B.weight": (32, 4)}), "LoRA on MoE experts"),
    ("embed", lambda p: _write_adapter(p, {
        "model.embed_tokens.lora_A.weight": (4, 64), "model.embed_tokens.lora_B.weight": (64, 4)}),
     "'model.embed_tokens' is not a LoRA target"),
    ("dora", lambda p: _write_adapter(p, _q(), use_dora=True), "DoRA adapters are not supported"),
    ("bias", lambda p: _write_adapter(p, _q(), bias="all"), "bias 'all' is not supported"),
    ("half", lambda p: _write_adapter(p, {"model.layers.0.self_attn.q_proj.lora_A.weight": (4, 64)}),
     "has only lora_A"),
    ("other tensor", lambda p: _write_adapter(p, {**_q(), "model.norm.weight": (64,)}),
     "unexpected tensor 'base_model.model.model.norm.weight'"),
    ("not peft", lambda p: str(p), "no adapter_config.json"),
])
def test_refusals_name_the_cause(llama, tmp_path, kind, make, message):
    path, cfg, targets = llama
    adapter_dir = make(tmp_path / "adapter")
    with pytest.raises(ValueError, match=message):
        adapter = load_peft_adapter(adapter_dir)
        adapter_weights(adapter, targets, cfg, max_rank=MAX_RANK, base_model=path)


def test_same_base_model_under_another_directory(llama, tmp_path):
    """A hub id and a local copy with the same last component are one model."""
    path, cfg, targets = llama
    adapter = load_peft_adapter(_write_adapter(tmp_path / "x", _q(),
                                               base_model_name_or_path="someorg/llama"))
    assert set(adapter_weights(adapter, targets, cfg, max_rank=MAX_RANK, base_model=path)) == {
        "layers.0.self_attn.q_proj"}


def test_stacks_sharded_as_their_base_kernels_on_1x2(llama, peft_dirs):
    """A split on its input for row-parallel projections, B on its output for
    column-parallel ones; writing a slot keeps the shardings; the sharded delta equals
    the unsharded one."""
    from jax.sharding import NamedSharding, PartitionSpec

    from models.lora.ops import sharded_lora_delta
    from models.lora.slots import stack_shardings
    from sharding.mesh import MODEL, make_mesh
    _, cfg, targets = llama
    mesh = make_mesh("1x2", jax.devices()[:2])
    shardings = stack_shardings(targets, mesh)
    adapter = load_peft_adapter(peft_dirs["b"])
    one = slot_weights(adapter_weights(adapter, targets, cfg, max_rank=MAX_RANK), adapter.scaling,
                       targets, MAX_RANK, np.float32)
    stacks = write_slot(init_stacks(targets, 2, MAX_RANK, jnp.float32, shardings), jnp.int32(1), one)
    plain = write_slot(init_stacks(targets, 2, MAX_RANK, jnp.float32), jnp.int32(1), one)
    spec = lambda name, ab: target_stacks(stacks, targets[name])["ab".index(ab)].sharding.spec
    assert spec("layers.0.self_attn.q_proj", "b") == PartitionSpec(None, None, MODEL)
    assert spec("layers.0.self_attn.o_proj", "a") == PartitionSpec(None, None, MODEL)   # [S, R, in]
    assert spec("layers.0.self_attn.q_proj", "a") == spec("layers.0.mlp.down_proj", "b") == PartitionSpec()
    slots = jnp.array([1, 0, 1, 2, 1], jnp.int32)
    for name in ("layers.0.self_attn.q_proj", "layers.0.self_attn.o_proj"):
        t = targets[name]
        x = jnp.asarray(np.random.default_rng(2).standard_normal((5, t.in_dim)), jnp.float32)
        x_spec = PartitionSpec(None, MODEL) if t.split == "in" else PartitionSpec()
        with jax.set_mesh(mesh):
            got = jax.jit(lambda x, s, a, b, c: sharded_lora_delta(
                x, group_by_slot(s, 3), a, b, c, t.split))(
                jax.device_put(x, NamedSharding(mesh, x_spec)), slots,
                *target_stacks(stacks, targets[name]), stacks[SCALES])
        want = lora_delta(x, group_by_slot(slots, 3), *target_stacks(plain, targets[name]), plain[SCALES])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert np.abs(np.asarray(want)).max() > 1e-3
