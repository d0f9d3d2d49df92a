"""ModelConfig from HF config.json files, in both RoPE formats."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from models.config import ModelConfig
from models.layers import rope_inv_freq
from tests.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {k: make_tiny_checkpoint(k, tmp_path_factory.mktemp(k), num_hidden_layers=2)
            for k in ["llama", "qwen3", "qwen3_moe"]}


def _hf(path) -> dict:
    with open(Path(path) / "config.json") as f:
        return json.load(f)


def test_llama_fields(dirs):
    cfg = ModelConfig.from_pretrained(dirs["llama"])
    assert cfg.architecture == "LlamaForCausalLM" and not cfg.qk_norm and not cfg.tie_word_embeddings
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (4, 2, 16, 2)
    assert cfg.rope_theta == 500000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    assert (cfg.eos_token_id, cfg.bos_token_id, cfg.dtype) == (2, 1, "float32")
    assert cfg.eos_token_ids == (2,)


def test_qwen3_families(dirs):
    q = ModelConfig.from_pretrained(dirs["qwen3"])
    assert q.qk_norm and q.tie_word_embeddings and q.rope_scaling is None and q.rope_theta == 1e6
    m = ModelConfig.from_pretrained(dirs["qwen3_moe"])
    # transformers 5 writes `num_local_experts`; older files `num_experts`.
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.norm_topk_prob) == (8, 2, 32, True)
    assert m.qk_norm and m.decoder_sparse_step == 1 and m.mlp_only_layers == ()
    d = _hf(dirs["qwen3_moe"])
    d["num_experts"] = d.pop("num_local_experts")
    d["mlp_only_layers"] = [1]
    m2 = ModelConfig.from_hf_dict(d)
    assert m2.num_experts == 8 and m2.mlp_only_layers == (1,)
    assert [m2.is_moe_layer(i) for i in range(2)] == [True, False]


@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_old_rope_format_gives_same_config(dirs, type_key):
    new = _hf(dirs["llama"])
    old = copy.deepcopy(new)
    params = old.pop("rope_parameters")
    old["rope_theta"] = params.pop("rope_theta")
    params[type_key] = params.pop("rope_type")
    old["rope_scaling"] = params
    assert ModelConfig.from_hf_dict(old) == ModelConfig.from_hf_dict(new)
    # Plain RoPE in the old format: rope_theta only, rope_scaling null.
    q = _hf(dirs["qwen3"])
    q_old = {k: v for k, v in q.items() if k != "rope_parameters"} | {"rope_theta": 1e6, "rope_scaling": None}
    assert ModelConfig.from_hf_dict(q_old) == ModelConfig.from_hf_dict(q)


def test_old_format_llama3_without_original_len_uses_max_positions(dirs):
    d = _hf(dirs["llama"])
    params = d.pop("rope_parameters")
    params.pop("original_max_position_embeddings")
    d["rope_theta"], d["rope_scaling"] = params.pop("rope_theta"), params
    assert ModelConfig.from_hf_dict(d).rope_scaling["original_max_position_embeddings"] == 512


def test_llama3_inv_freq_matches_transformers(dirs):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(dirs["llama"]), torch.device("cpu"))
    cfg = ModelConfig.from_pretrained(dirs["llama"])
    ours = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)
    plain = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
    assert (ours < plain).any() and (ours == plain).any()   # scaling bites on some dims only


def test_unsupported_rope_type_is_named(dirs):
    d = _hf(dirs["llama"])
    d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ValueError, match="'yarn'"):
        ModelConfig.from_hf_dict(d)


def test_missing_dir_and_config(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ModelConfig.from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_frozen_hashable_and_eos_list(dirs):
    d = _hf(dirs["qwen3"])
    d["eos_token_id"] = [1, 5]
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.eos_token_id == (1, 5) and cfg.eos_token_ids == (1, 5)
    llama = ModelConfig.from_pretrained(dirs["llama"])
    assert hash(llama) == hash(ModelConfig.from_pretrained(dirs["llama"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        llama.vocab_size = 3


def test_head_dim_defaults_and_validation(dirs):
    d = _hf(dirs["llama"])
    d.pop("head_dim")
    assert ModelConfig.from_hf_dict(d).head_dim == 64 // 4
    d["num_key_value_heads"] = 3
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig.from_hf_dict(d)
    d2 = _hf(dirs["llama"])
    del d2["vocab_size"]
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig.from_hf_dict(d2)


def test_gemma4_builtin_configs_read_as_published():
    """The four Gemma 4 sizes: layer patterns, the global layers' own attention shape,
    KV sharing and per-layer embeddings as published; parameter counts as announced."""
    from jaxserve.checkpoints.model_names import builtin_config
    big = ModelConfig.from_hf_dict(builtin_config("gemma-4-31b"))
    assert big.architecture == "Gemma4ForConditionalGeneration" and big.num_layers == 60
    assert big.full_attention_layers == tuple(range(5, 60, 6)) and big.sliding_window == 1024
    assert (big.layer_head_dim(0), big.layer_num_kv_heads(0)) == (256, 16)
    assert (big.layer_head_dim(5), big.layer_num_kv_heads(5)) == (512, 4)
    assert big.attention_k_eq_v and big.final_logit_softcapping == 30.0
    assert big.rope_scaling["rope_type"] == "proportional" and big.eos_token_ids == (1, 106)
    moe = ModelConfig.from_hf_dict(builtin_config("gemma-4-26b-a4b"))
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 704)
    e2b = ModelConfig.from_hf_dict(builtin_config("gemma-4-e2b"))
    assert e2b.full_attention_layers == (4, 9, 14)           # 4:1, then KV sharing from 15
    assert e2b.kv_source(15) == 13 and e2b.kv_source(19) == 14 and e2b.kv_source(34) == 14
    assert e2b.mlp_width(14) == 6144 and e2b.mlp_width(15) == 12288
    assert e2b.hidden_size_per_layer_input == 256
    e4b = ModelConfig.from_hf_dict(builtin_config("gemma-4-e4b"))
    assert e4b.kv_source(29) == 23 and len(e4b.kv_layers()) == 24


def test_gemma4_configs_refused_by_name():
    from jaxserve.checkpoints.model_names import builtin_config
    for key, value, needle in (("hidden_activation", "silu", "hidden_activation"),
                               ("use_bidirectional_attention", "all", "bidirectional"),
                               ("attn_logit_softcapping", 50.0, "attn_logit_softcapping")):
        cfg = builtin_config("gemma-4-e2b")
        cfg["text_config"][key] = value
        with pytest.raises(ValueError, match=needle):
            ModelConfig.from_hf_dict(cfg)
