"""python -m jaxserve.plan: figures checked against the model config by hand-free algebra."""
from __future__ import annotations

import pytest

from jaxserve.plan import BUILTIN_CONFIGS, load_model_config, main, make_plan, parse_bytes

GIB = 2**30


def test_qwen3_8b_on_1x8():
    mc = load_model_config("qwen3-8b")
    c = BUILTIN_CONFIGS["qwen3-8b"]
    e, f, v, n_layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], \
        c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    per_layer = e * q * 2 + e * kv * 2 + 3 * e * f + 2 * e + 2 * c["head_dim"]
    params = n_layers * per_layer + 2 * v * e + e          # untied lm_head, final norm
    p = make_plan(mc, model="qwen3-8b", mesh="1x8", hbm_bytes=80 * GIB)
    assert p.num_params == params and 8.1e9 < params < 8.3e9
    norms = (n_layers * (2 * e + 2 * c["head_dim"]) + e) * 2
    assert p.weight_bytes_per_device == (params * 2 - norms) // 8 + norms
    assert p.kv_bytes_per_token_per_device == n_layers * 2 * 1 * c["head_dim"] * 2   # 1 head
    free = 80 * GIB - p.weight_bytes_per_device
    assert p.kv_tokens == int(free * 0.9) // p.kv_bytes_per_token_per_device
    assert p.allreduce_bytes_per_token_per_layer == 2 * e * 2
    assert p.allreduce_seconds(16384) == pytest.approx(2 * 7 / 8 * 16384 / 450e9)


def test_replicated_kv_heads_and_data_parallel_in_the_plan():
    mc = load_model_config("qwen3-8b")
    p = make_plan(mc, model="qwen3-8b", mesh="2x16", hbm_bytes=80 * GIB)
    assert (p.kv_heads, p.kv_heads_stored) == (8, 16)   # each KV head on 2 devices
    assert p.kv_bytes_per_token_per_device == 36 * 2 * 1 * 128 * 2
    assert p.num_params == make_plan(mc, model="x", mesh="1x1").num_params


def test_cli_prints_the_plan(capsys, checkpoint):
    main(["--model", "qwen3-8b", "--mesh", "1x8", "--hbm", "80GiB"])
    out = capsys.readouterr().out
    assert "8,190,735,360" in out and "1.91 GiB" in out and "18.0 KiB" in out
    main(["--model", checkpoint("qwen3"), "--mesh", "1x4", "--max-model-len", "128"])
    out = capsys.readouterr().out
    assert "Qwen3ForCausalLM" in out and "give --hbm" in out
    with pytest.raises(SystemExit) as e:
        main(["--model", "qwen3-8b", "--mesh", "1x3"])
    assert e.value.code == 2
    assert "num_attention_heads=32" in capsys.readouterr().err


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * GIB and parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1024") == 1024
    with pytest.raises(ValueError, match="size"):
        parse_bytes("80 parsecs")
