"""The mesh, the rules table, the dimension checks and weights loaded into their shards."""
from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from jax._src.interpreters import pxla
from jax.sharding import PartitionSpec as P

from jaxserve import LLM
from models.config import ModelConfig
from models.registry import build_model
from models.weights import load_params, param_logical_axes
from sharding import (MODEL, bytes_per_device, check_model_axis, kv_head_layout, make_mesh,
                      mesh_rules, param_shardings, replica_meshes)


def _config(**kw) -> ModelConfig:
    base = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=256, hidden_size=64,
                intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32)
    return ModelConfig.from_hf_dict({**base, **kw})


def test_make_mesh_axes_and_devices():
    mesh = make_mesh("2x4")
    assert mesh.axis_names == ("data", "model") and dict(mesh.shape) == {"data": 2, "model": 4}
    assert list(mesh.devices.flat) == jax.devices()[:8]
    subs = replica_meshes(mesh)
    assert [list(s.devices.flat) for s in subs] == [jax.devices()[:4], jax.devices()[4:8]]
    assert list(make_mesh("1x2").devices.flat) == jax.devices()[:2]   # a subset is fine


@pytest.mark.parametrize("spec", ["1x16", "3x3", "9x1"])
def test_too_many_devices_names_how_many_exist(spec):
    with pytest.raises(ValueError, match=r"only 8 exist"):
        make_mesh(spec)


@pytest.mark.parametrize("spec", ["8", "axb", "1x0", "0x2"])
def test_bad_mesh_spec(spec):
    with pytest.raises(ValueError, match="mesh"):
        make_mesh(spec)


def test_undividable_dimensions_name_themselves_and_the_sizes_that_work():
    with pytest.raises(ValueError,
                       match=r"M=3 does not divide num_attention_heads=8; .*: 1, 2, 4, 8$"):
        check_model_axis(_config(), 3)
    with pytest.raises(ValueError, match=r"M=8 does not divide moe_intermediate_size=20; "
                                         r".*: 1, 2, 4$"):
        check_model_axis(_config(moe_intermediate_size=20, intermediate_size=100), 8)
    with pytest.raises(ValueError,
                       match=r"M=8 does not divide intermediate_size=100; .*: 1, 2, 4$"):
        check_model_axis(_config(architectures=["Qwen3ForCausalLM"], num_experts=0,
                                 intermediate_size=100), 8)
    check_model_axis(_config(vocab_size=250), 8)   # the vocabulary need not divide


def test_kv_head_layout():
    assert kv_head_layout(8, 8, 4) == 8      # split: 2 per device
    assert kv_head_layout(8, 2, 4) == 4      # each head on 2 devices, 1 per device
    assert kv_head_layout(32, 8, 16) == 16
    assert kv_head_layout(24, 4, 6) == 12    # lcm: 2 per device, no device holds a stray head
    assert kv_head_layout(8, 2, 1) == 2


def test_rules_give_megatron_shardings():
    mc = _config()
    mesh = make_mesh("1x4")
    axes = param_logical_axes(build_model(mc, "float32", "reference"))
    specs = {k: v.spec for k, v in flatten_dict(param_shardings(axes, mesh,
                                                                mesh_rules(mc, 4))).items()}
    layer = ("layers_0",)
    assert specs[("embed_tokens", "embedding")] == P(MODEL, None)          # vocab-parallel
    assert specs[("lm_head", "kernel")] == P(None, MODEL)
    assert specs[layer + ("self_attn", "q_proj", "kernel")] == P(None, MODEL, None)
    assert specs[layer + ("self_attn", "k_proj", "kernel")] == P(None, MODEL, None)
    assert specs[layer + ("self_attn", "o_proj", "kernel")] == P(MODEL, None, None)
    assert specs[layer + ("mlp", "experts", "gate_proj")] == P(None, None, MODEL)
    assert specs[layer + ("mlp", "experts", "down_proj")] == P(None, MODEL, None)
    assert specs[layer + ("mlp", "gate", "kernel")] == P(None, None)       # router
    assert specs[layer + ("input_layernorm", "scale")] == P(None)
    odd = _config(vocab_size=250)
    rules = mesh_rules(odd, 4)
    specs = flatten_dict(param_shardings(axes, mesh, rules))
    assert specs[("embed_tokens", "embedding")].spec == P(None, None)      # replicated


def test_weights_load_straight_into_their_shards(checkpoint, monkeypatch):
    """Each device receives only its slice of a sharded tensor (the host->device
    transfers are watched), its shard is exactly that slice of the checkpoint tensor,
    and replicated KV heads are copies of the checkpoint's heads."""
    path = checkpoint("qwen3_moe")
    mc = ModelConfig.from_pretrained(path)
    whole = flatten_dict(load_params(path, mc, build_model(mc, "float32", "reference"), "float32"))
    m = 8
    stored = kv_head_layout(mc.num_heads, mc.num_kv_heads, m)
    model = build_model(replace(mc, num_kv_heads=stored), "float32", "reference")
    mesh = make_mesh(f"1x{m}")
    shardings = param_shardings(param_logical_axes(model), mesh, mesh_rules(mc, m))
    sent = []
    real_put = pxla.batched_device_put

    def watch(aval, sharding, xs, devices, *args, **kwargs):
        sent.append((sharding, aval.shape, [np.shape(x) for x in xs]))
        return real_put(aval, sharding, xs, devices, *args, **kwargs)
    monkeypatch.setattr(pxla, "batched_device_put", watch)
    params = load_params(path, mc, model, "float32", shardings=shardings,
                         kv_head_repeat=stored // mc.num_kv_heads)
    monkeypatch.undo()
    sharded = [(shape, pieces) for sh, shape, pieces in sent if MODEL in tuple(sh.spec)]
    assert len(sharded) == sum(MODEL in tuple(x.spec) for x in flatten_dict(shardings).values())
    for shape, pieces in sharded:   # m pieces, each 1/m of the tensor: never the whole
        assert len(pieces) == m and all(np.prod(p) * m == np.prod(shape) for p in pieces)
    expected_bytes = 0
    for path_, x in flatten_dict(params).items():
        ref = np.asarray(whole[path_])
        if path_[-2] in ("k_proj", "v_proj"):
            ref = np.repeat(ref, stored // mc.num_kv_heads, axis=1)
        assert x.sharding == flatten_dict(shardings)[path_]
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), ref[shard.index])
        small = path_[-1] == "scale" or path_[-2] == "gate"   # norms, router: replicated
        expected_bytes += ref.nbytes if small else ref.nbytes // m
    # Per device: 1/M of everything but norms and router; the replicated KV heads
    # cost each device its own heads only (stored / M of them).
    assert bytes_per_device(params) == expected_bytes


def test_engine_rejects_impossible_meshes(checkpoint):
    path = checkpoint("qwen3")
    with pytest.raises(ValueError, match="only 8 exist"):
        LLM(path, mesh="2x8")
    with pytest.raises(ValueError, match="num_attention_heads=8"):
        LLM(path, mesh="1x3")
    with pytest.raises(ValueError, match="num_attention_heads=8"):
        LLM(path, mesh="2x3")
