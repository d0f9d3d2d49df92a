"""Weight loading: dtypes, shards, dummy weights, error messages, the safetensors reader."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax.traverse_util import flatten_dict
from safetensors.torch import load_file, save_file

from models import weights
from models.config import ModelConfig
from models.layer_stack import cache_shapes
from models.registry import ARCHITECTURES, build_model, get_model_class
from models.safetensors_io import SafeTensorsFile
from models.weights import abstract_params, load_params, param_bytes, param_logical_axes
from tests.checkpoints import make_tiny_checkpoint
from tests.models.batch_util import make_inputs


def _load(path, dtype="auto", **kw):
    cfg = ModelConfig.from_pretrained(path)
    model = build_model(cfg, dtype)
    return cfg, model, load_params(path, cfg, model, dtype, **kw)


def test_bf16_checkpoint_loads_as_bf16(tmp_path):
    path = make_tiny_checkpoint("qwen3", tmp_path, dtype=torch.bfloat16, num_hidden_layers=2)
    cfg, model, params = _load(path, "auto")
    assert cfg.dtype == "bfloat16"
    leaves = jax.tree_util.tree_leaves(params)
    assert leaves and all(x.dtype == jnp.bfloat16 for x in leaves)
    # Bit-exact copy of the file's values, in our layout (q_proj [N*H, E] -> [E, N, H]).
    ref = load_file(str(Path(path) / "model.safetensors"))
    q = ref["model.layers.1.self_attn.q_proj.weight"].float().numpy()
    got = np.asarray(params["layers_1"]["self_attn"]["q_proj"]["kernel"]).astype(np.float32)
    np.testing.assert_array_equal(got, q.T.reshape(got.shape))
    # And the bf16 model runs and roughly agrees with the float32 model on the same weights.
    cfg32, model32, params32 = _load(path, jnp.float32)
    toks = np.arange(3, 40)
    outs = []
    for m, p, dt in [(model, params, jnp.bfloat16), (model32, params32, jnp.float32)]:
        inputs, _ = make_inputs([(toks, 0, [3, 1, 2])])
        caches = {k: jnp.zeros(v.shape, v.dtype) for k, v in cache_shapes(
            cfg, num_pages=24, page_size=16, kv_dtype=dt, num_state_slots=0,
            conv_state_dtype=dt).items()}
        hidden, _ = m.apply({"params": p}, caches, inputs)
        outs.append(np.asarray(m.apply({"params": p}, hidden[:len(toks)], method="compute_logits")))
    assert outs[0].dtype == np.float32 and np.isfinite(outs[0]).all()
    assert np.abs(outs[0] - outs[1]).max() < 0.1 * max(1.0, np.abs(outs[1]).max())


def test_sharded_checkpoint_equals_single_file(tmp_path):
    single = make_tiny_checkpoint("qwen3_moe", tmp_path / "single", seed=3)
    sharded = make_tiny_checkpoint("qwen3_moe", tmp_path / "sharded", seed=3, max_shard_size="40KB")
    assert (Path(sharded) / "model.safetensors.index.json").is_file()
    assert len(list(Path(sharded).glob("*.safetensors"))) > 2
    _, _, a = _load(single, jnp.float32)
    _, _, b = _load(sharded, jnp.float32)
    fa, fb = flatten_dict(a), flatten_dict(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=str(k))
    # Stacked experts: expert 5's gate_proj is the file's tensor, transposed to [E, F].
    ref = load_file(str(Path(single) / "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(a["layers_1"]["mlp"]["experts"]["gate_proj"][5]),
                                  ref["model.layers.1.mlp.experts.5.gate_proj.weight"].numpy().T)


def test_shardings_hook_places_each_param(llama_dir):
    cfg = ModelConfig.from_pretrained(llama_dir)
    model = build_model(cfg, jnp.float32)
    device = jax.devices()[-1]
    target = jax.tree_util.tree_map(lambda _: jax.sharding.SingleDeviceSharding(device), abstract_params(model))
    for fmt in ["safetensors", "dummy"]:
        params = load_params(llama_dir, cfg, model, jnp.float32, load_format=fmt, shardings=target)
        assert all(x.devices() == {device} for x in jax.tree_util.tree_leaves(params))


def test_unsupported_architecture():
    with pytest.raises(ValueError, match="Architecture 'FooForCausalLM' is not supported; supported: "):
        get_model_class("FooForCausalLM")
    try:
        get_model_class("FooForCausalLM")
    except ValueError as e:
        assert all(name in str(e) for name in ARCHITECTURES)
    cfg = ModelConfig(architecture="GPT2LMHeadModel", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        build_model(cfg, jnp.float32)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), num_hidden_layers=2)


def _rewrite(src: str, dst: Path, edit) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_missing_tensors_are_named(llama_dir, tmp_path):
    path = _rewrite(llama_dir, tmp_path / "m", lambda t: (t.pop("model.layers.1.mlp.up_proj.weight"),
                                                          t.pop("lm_head.weight")))
    with pytest.raises(ValueError, match="lacks 2 tensors") as e:
        _load(path, jnp.float32)
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value) and "lm_head.weight" in str(e.value)


def test_unexpected_tensors_are_named(llama_dir, tmp_path):
    def add(t):
        for i in range(7):
            t[f"model.layers.{i + 5}.extra.weight"] = torch.zeros(3)
    path = _rewrite(llama_dir, tmp_path / "u", add)
    with pytest.raises(ValueError, match="7 unexpected tensors") as e:
        _load(path, jnp.float32)
    assert "model.layers.5.extra.weight" in str(e.value) and "7 in all" in str(e.value)


def test_wrong_shape_is_named(llama_dir, tmp_path):
    path = _rewrite(llama_dir, tmp_path / "s", lambda t: t.update(
        {"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_proj.weight"):
        _load(path, jnp.float32)


def test_a_param_of_the_wrong_shape_is_named_when_applied(llama_dir):
    """apply reads params without flax's per-param initializer trace: its own check
    still names a param whose shape the model does not expect."""
    cfg = ModelConfig.from_pretrained(llama_dir)
    model = build_model(cfg, jnp.float32)
    params = load_params(llama_dir, cfg, model, jnp.float32)
    w = params["layers_1"]["mlp"]["down_proj"]["kernel"]
    params["layers_1"]["mlp"]["down_proj"]["kernel"] = w[:-1]
    inputs, _ = make_inputs([(np.arange(3, 7), 0, [1])], num_tokens=8, num_rows=2)
    caches = {k: jnp.zeros(s.shape, s.dtype) for k, s in cache_shapes(
        cfg, num_pages=4, page_size=16, kv_dtype=jnp.float32, num_state_slots=0,
        conv_state_dtype=jnp.float32).items()}
    with pytest.raises(ValueError, match=r"param layers_1/mlp/down_proj/kernel has shape "
                                         rf"\({w.shape[0] - 1}, {w.shape[1]}\), the model "
                                         rf"expects \({w.shape[0]}, {w.shape[1]}\)"):
        model.apply({"params": params}, caches, inputs)


def test_missing_directory():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="does not exist"):
        load_params("/nonexistent/dir", cfg, build_model(cfg, jnp.float32), jnp.float32)


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_dummy_weights(tmp_path, kind, where, monkeypatch):
    """Small models' dummy weights are drawn on the host, larger ones on their devices
    (forced here by a zero threshold): the same kinds of values either way."""
    if where == "device":
        monkeypatch.setattr(weights, "_HOST_DUMMY_BYTES", 0)
    path = make_tiny_checkpoint(kind, tmp_path)
    cfg = ModelConfig.from_pretrained(path)
    model = build_model(cfg, jnp.bfloat16)
    params = load_params(None, cfg, model, jnp.bfloat16, load_format="dummy", seed=1)
    again = load_params(None, cfg, model, jnp.bfloat16, load_format="dummy", seed=1)
    other = load_params(None, cfg, model, jnp.bfloat16, load_format="dummy", seed=2)
    expected = flatten_dict(abstract_params(model))
    got = flatten_dict(params)
    assert got.keys() == expected.keys()
    for k, sds in expected.items():
        assert got[k].shape == sds.shape and got[k].dtype == jnp.bfloat16, k
    assert np.all(np.asarray(got[("norm", "scale")], np.float32) == 1.0)
    emb = np.asarray(got[("embed_tokens", "embedding")], np.float32)
    assert abs(emb.std() - 0.02) < 0.003
    np.testing.assert_array_equal(emb, np.asarray(again["embed_tokens"]["embedding"], np.float32))
    assert not np.array_equal(emb, np.asarray(other["embed_tokens"]["embedding"], np.float32))
    n = sum(int(np.prod(s.shape)) for s in expected.values())
    assert param_bytes(params) == 2 * n
    # Same parameter count as the torch model (tied embeddings counted once).
    from transformers import AutoModelForCausalLM
    assert n == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())


def test_logical_axes():
    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=16, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=4, qk_norm=True)
    axes = param_logical_axes(build_model(cfg, jnp.float32))
    assert tuple(axes["layers_0"]["self_attn"]["q_proj"]["kernel"]) == ("embed", "heads", "head_dim")
    assert tuple(axes["layers_0"]["self_attn"]["k_proj"]["kernel"]) == ("embed", "kv_heads", "head_dim")
    assert tuple(axes["layers_0"]["mlp"]["experts"]["down_proj"]) == ("experts", "expert_mlp", "embed")
    assert tuple(axes["embed_tokens"]["embedding"]) == ("vocab", "embed")
    assert tuple(axes["lm_head"]["kernel"]) == ("embed", "vocab")


def test_safetensors_reader_matches_library(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, generator=g).to(torch.float16),
        "f32": torch.randn(2, 3, 4, generator=g),
        "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "i64": torch.tensor([1, -2], dtype=torch.int64),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
        "f8": torch.randn(4, 3, generator=g).to(torch.float8_e4m3fn),
        "f8_e5m2": torch.randn(5, generator=g).to(torch.float8_e5m2),
    }
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata={"format": "pt"})
    st = SafeTensorsFile(tmp_path / "t.safetensors")
    assert sorted(st.keys()) == sorted(tensors)
    assert st.metadata() == {"format": "pt"}
    assert st.get("bf16").dtype == ml_dtypes.bfloat16
    assert st.get("f8").dtype == ml_dtypes.float8_e4m3fn
    for name, t in tensors.items():
        got = st.get(name)
        assert got.shape == tuple(t.shape) == st.shape(name), name
        assert st.nbytes(name) == t.numel() * t.element_size(), name
        np.testing.assert_array_equal(got.astype(np.float64), t.double().numpy(), err_msg=name)
    # Views of the file, not copies: a slice reads only its pages.
    assert not st.get("f32").flags.owndata and not st.get("f32").flags.writeable


def test_safetensors_reader_rejects_garbage(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="not a safetensors file"):
        SafeTensorsFile(tmp_path / "bad.safetensors")
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "short.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(ValueError, match="short.safetensors' is not a safetensors file"):
        SafeTensorsFile(tmp_path / "short.safetensors")
    # A gap before a tensor: the reader derives offsets from the tiling, so it must refuse it.
    header = json.dumps({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}).encode()
    (tmp_path / "hole.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(ValueError, match="hole.safetensors' is not a safetensors file"):
        SafeTensorsFile(tmp_path / "hole.safetensors")
    header = json.dumps({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "c64.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(ValueError, match="tensor 'x' has unsupported dtype 'C64'"):
        SafeTensorsFile(tmp_path / "c64.safetensors")
