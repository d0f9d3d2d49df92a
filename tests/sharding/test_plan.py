"""python -m jaxserve.plan: figures checked against the model config by hand-free algebra."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from jaxserve.checkpoints.model_configs import BUILTIN_CONFIGS
from jaxserve.checkpoints.model_names import load_model_config
from jaxserve.planning.plan import WeightFigures, format_plan, make_plan, parse_bytes
from jaxserve.cli.plan import main

GIB = 2**30


def paged_tokens(budget: int, per_token: int, page_size: int = 16) -> int:
    """The engine's rule (build/cache_plan.py): whole pages, less the null page."""
    return max(budget // (per_token * page_size) - 1, 0) * page_size


def cache_budget(hbm: int, weights: int, activation: int, utilization: float = 0.9) -> int:
    """vLLM's --gpu-memory-utilization: the engine holds `utilization` of the device;
    the caches get it less the weights and the reserve (the activation estimate, at
    least 5 % of the engine's share)."""
    engine = int(hbm * utilization)
    return max(0, engine - weights - max(activation, int(engine * 0.05)))


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
    budget = cache_budget(80 * GIB, p.weight_bytes_per_device, p.activation_bytes)
    assert p.kv_tokens == paged_tokens(budget, p.kv_bytes_per_token_per_device)
    # Of the 80 GiB the engine leaves 10 % alone; the rest is weights, reserve and cache.
    m = p.to_json()["memory"]
    assert m["engine_bytes"] == int(0.9 * 80 * GIB) and m["outside_engine_bytes"] == 8 * GIB
    assert m["weight_bytes"] + m["reserve_bytes"] + m["kv_page_bytes"] + m["unused_bytes"] \
        == m["engine_bytes"] and m["unused_bytes"] < p.cache.bytes_per_page
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


def test_cli_json_has_the_derived_figures(capsys):
    main(["--model", "qwen3-8b", "--mesh", "1x8", "--hbm", "80GiB", "--json"])
    got = json.loads(capsys.readouterr().out)
    p = make_plan(load_model_config("qwen3-8b"), model="qwen3-8b", mesh="1x8",
                  hbm_bytes=80 * GIB)
    assert got["weight_bytes_per_device"] == p.weight_bytes_per_device > 0
    assert got["kv_bytes_per_token_per_device"] == 18 * 2**10
    assert got["kv_tokens"] == p.kv_tokens == got["cache"]["num_pages"] * 16 - 16
    assert got["max_concurrency"] == p.kv_tokens // p.max_model_len == 94
    assert got["fits"] is False and got["state_slots"] == 0


@pytest.mark.parametrize("scheme", ["fp8"])   # int8: the same bytes (test_quantized_tpu_compile.py)
def test_cli_json_bytes_follow_quantization(capsys, scheme):
    """qwen3.6-27b on one 80 GiB GPU: quantized linear layers hold about half the bf16
    bytes (embeddings, lm_head and norms stay bf16), a quantized KV cache half the bytes
    per token, and the freed memory holds more full-length sequences."""
    def plan(*flags: str) -> dict:
        main(["--model", "qwen3.6-27b", "--hbm", "80GiB", "--max-model-len", "32768",
              "--max-num-seqs", "16", "--json", *flags])
        return json.loads(capsys.readouterr().out)
    base, quant = plan(), plan("--quantization", scheme, "--kv-cache-dtype", scheme)
    assert base["quantization"] is None and quant["quantization"] == scheme
    assert 0.5 < quant["weight_bytes_per_device"] / base["weight_bytes_per_device"] < 0.6
    assert quant["kv_bytes_per_token_per_device"] * 2 == base["kv_bytes_per_token_per_device"]
    assert quant["max_concurrency"] > base["max_concurrency"]
    assert quant["kv_dtype"] == ("float8_e4m3fn" if scheme == "fp8" else "int8")


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * GIB and parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1024") == 1024
    with pytest.raises(ValueError, match="size"):
        parse_bytes("80 parsecs")


# ---- hybrid models: the analytic parts, with the weights given by hand --------------

MIB = 2**20


def qwen36_27b_params() -> int:
    """Text parameters of Qwen3.6-27B counted from the published shapes."""
    e, f, v, hd = 5120, 17408, 248320, 256
    full = e * 24 * hd * 2 + 2 * e * 4 * hd + 24 * hd * e + 2 * hd    # q+gate, k, v, o, q/k norms
    conv = 2 * 16 * 128 + 48 * 128                                      # q|k|v channels: 10240
    linear = (e * conv + e * 48 * 128 + 2 * e * 48 + 48 * 128 * e       # qkv, z, a, b, out
              + conv * 4 + 48 + 48 + 128)                               # conv, A_log, dt_bias, norm
    return 2 * v * e + 64 * 3 * e * f + 16 * full + 48 * linear + 64 * 2 * e + e


def hand_weights(num_params: int, m: int) -> WeightFigures:
    total = num_params * 2                                              # bfloat16
    return WeightFigures(num_params, total, total // m, 0)


def test_qwen36_27b_analytic_count():
    assert qwen36_27b_params() == pytest.approx(26.9e9, rel=0.005)


def snapshot_slots(budget: int, per_slot: int, max_num_seqs: int) -> int:
    """The prefix cache's state snapshots: their share of the budget, capped per sequence."""
    from jaxserve.build.cache_plan import MAX_SNAPSHOTS_PER_SEQ, SNAPSHOT_BUDGET_SHARE
    return min(int(budget * SNAPSHOT_BUDGET_SHARE) // per_slot, MAX_SNAPSHOTS_PER_SEQ * max_num_seqs)


@pytest.mark.parametrize("mesh, kv_heads_per_device, split", [("1x1", 4, 1), ("1x8", 1, 8)])
def test_qwen36_27b_plan_figures(mesh, kv_heads_per_device, split):
    mc = load_model_config("qwen3.6-27b")
    m = int(mesh[2:])
    w = hand_weights(qwen36_27b_params(), m)
    p = make_plan(mc, model="qwen3.6-27b", mesh=mesh, hbm_bytes=80 * GIB, max_num_seqs=16,
                  max_model_len=16384, weights=w)
    assert p.dtype == "bfloat16" and p.full_attention_layers == 16
    # 16 full-attention layers x KV heads on this device x 256 x K and V x 2 bytes.
    assert p.kv_bytes_per_token_per_device == 16 * kv_heads_per_device * 256 * 2 * 2
    if m == 1:
        assert p.kv_bytes_per_token_per_device == 64 * 2**10
    # 48 DeltaNet layers x (conv state 3 x 10240 bf16 + delta-rule state 48 x 128 x 128 f32).
    state = 48 * (3 * 10240 * 2 + 48 * 128 * 128 * 4)
    assert p.state_bytes_per_seq == state and 146 * MIB < state < 148 * MIB
    assert p.state_bytes_per_seq_per_device == state // split
    # The engine: 0.9 of the device less the weights and the reserve; 17 state slots and
    # the prefix cache's snapshots first, pages the rest.
    budget = cache_budget(80 * GIB, w.bytes_per_device, p.activation_bytes)
    assert p.state_slots == 17
    snaps = snapshot_slots(budget, state // split, 16)
    assert p.cache.num_snapshot_slots == snaps > 0
    assert p.kv_tokens == paged_tokens(budget - (17 + snaps) * (state // split),
                                       p.kv_bytes_per_token_per_device)
    assert p.max_sequences == min(16, p.kv_tokens // 16384)
    # One 80 GiB device: 72 GiB for the engine, 50 GiB of it weights: 14 of the 16
    # sequences fit. Eight devices hold them all.
    assert p.fits == (16 * 16384 <= p.kv_tokens) == (m == 8)
    out = format_plan(p)
    assert ("WARNING" in out) != p.fits, out
    assert "16 full attention (KV cache), 48 linear attention" in out
    assert "state slots                17 (max_num_seqs + 1)" in out
    assert f"{p.kv_tokens:,} tokens" in out


def test_qwen36_27b_plan_that_does_not_fit():
    mc = load_model_config("qwen3.6-27b")
    w = hand_weights(qwen36_27b_params(), 1)
    state = mc.state_bytes_per_seq(2)
    # 80 GiB on one device: ~50 GiB of weights, ~18 GiB of cache; 262,144-token sequences.
    p = make_plan(mc, model="qwen3.6-27b", mesh="1x1", hbm_bytes=80 * GIB, max_num_seqs=16,
                  weights=w)
    assert p.max_model_len == 262144 and not p.fits
    budget = cache_budget(80 * GIB, w.weight_bytes, p.activation_bytes)
    snaps = snapshot_slots(budget, state, 16)
    assert p.kv_tokens == paged_tokens(budget - (17 + snaps) * state, 64 * 2**10)
    assert p.max_sequences == p.kv_tokens // 262144 == 0
    out = format_plan(p)
    assert "WARNING: the plan does not fit: 16 sequences of 262,144 tokens" in out
    # 257 state slots alone (~36.8 GiB) exceed the cache budget.
    p = make_plan(mc, model="qwen3.6-27b", mesh="1x1", hbm_bytes=80 * GIB, max_num_seqs=256,
                  weights=w)
    assert p.state_budget_bytes == (257 + p.cache.num_snapshot_slots) * state > p.kv_budget_bytes
    assert p.kv_tokens == 0 and p.max_sequences == 0 and not p.fits
    assert "WARNING: the recurrent state of 257 sequences" in format_plan(p)
    # Weights larger than the device.
    p = make_plan(mc, model="qwen3.6-27b", mesh="1x1", hbm_bytes=40 * GIB, weights=w)
    assert "WARNING: the weights do not fit" in format_plan(p)


def test_the_model_axis_must_divide_the_deltanet_key_heads():
    mc = replace(load_model_config("qwen3.6-27b"), linear_num_key_heads=4,
                 linear_num_value_heads=12)
    with pytest.raises(ValueError, match="does not divide linear_num_key_heads=4.*1, 2, 4"):
        make_plan(mc, model="x", mesh="1x8", weights=hand_weights(10**9, 8))


def test_non_hybrid_plans_have_no_state():
    mc = load_model_config("qwen3-8b")
    p = make_plan(mc, model="qwen3-8b", mesh="1x8", hbm_bytes=80 * GIB, max_num_seqs=8,
                  max_model_len=4096, weights=hand_weights(8 * 10**9, 8))
    assert (p.state_slots, p.state_budget_bytes, p.full_attention_layers) == (0, 0, 36)
    assert p.kv_tokens == paged_tokens(cache_budget(80 * GIB, 2 * 10**9, p.activation_bytes),
                                       p.kv_bytes_per_token_per_device)
    out = format_plan(p)
    assert "state" not in out and "WARNING" not in out and "(36 layers x K and V)" in out


def test_load_model_config_accepts_repo_ids_and_the_hf_cache(tmp_path, monkeypatch):
    assert load_model_config("Qwen/Qwen3.6-35B-A3B").num_experts == 256
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snap = tmp_path / "models--org--m" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(BUILTIN_CONFIGS["llama-3.1-8b"]))
    assert load_model_config("org/m").architecture == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="qwen3.6-27b"):
        load_model_config("no-such-model")


def test_the_cache_leaves_room_for_the_sampler():
    """Qwen3.6-27B on a v6e 1x8 (31.25 GiB usable per chip): 5 % of the engine's 90 %
    (1.4 GiB) is less than the costliest sampler's temporaries over 256 rows of 248,320
    logits (XLA:TPU: 2.85 GB), so the reserve grows to the estimate instead and the cache
    shrinks by as much; with 8 rows the 5 % floor stands. The penalties' token history
    [rows, max_model_len] int32 comes on top (XLA:TPU: +260 MB of arguments at 262,144
    tokens, which took the default-context flagship past the chip)."""
    from jaxserve.build.kv_budget import SAMPLER_COPIES, WORKSPACE_SHARE, memory_split
    mc = load_model_config("qwen3.6-27b")
    kw = dict(model="qwen3.6-27b", mesh="1x8", max_model_len=8192, hbm_bytes=int(31.25 * GIB))
    p = make_plan(mc, **kw)
    engine = int(0.9 * 31.25 * GIB)
    assert p.activation_bytes >= SAMPLER_COPIES * 256 * mc.vocab_size * 4 > 2.85e9
    assert p.reserve_bytes == p.activation_bytes > WORKSPACE_SHARE * engine
    assert p.kv_budget_bytes == engine - p.weight_bytes_per_device - p.activation_bytes
    long = make_plan(mc, **{**kw, "max_model_len": 262144})
    assert long.activation_bytes - p.activation_bytes == 256 * (262144 - 8192) * 4
    assert long.kv_budget_bytes == p.kv_budget_bytes - 256 * (262144 - 8192) * 4
    small = make_plan(mc, max_num_seqs=8, **kw)
    assert small.reserve_bytes == int(WORKSPACE_SHARE * engine) > small.activation_bytes
    # The split: the engine's share (never past JAX's pool), weights, reserve, caches.
    split = memory_split(100, 0.9, 50, 10)
    assert (split.engine_bytes, split.reserve_bytes, split.cache_bytes,
            split.outside_bytes) == (90, 10, 30, 10)
    assert memory_split(100, 0.9, 50, 1).reserve_bytes == 4        # 5 % of 90
    assert memory_split(100, 0.9, 50, 10, pool_bytes=75).cache_bytes == 15
    assert memory_split(100, 0.5, 60, 1).cache_bytes == 0


def test_expert_parallel_plan(capsys):
    """--enable-expert-parallel moves whole experts, not bytes: the same weights per
    device as tensor-parallel experts, said in the header; refused for a dense model."""
    mc = load_model_config("qwen3-30b-a3b")
    tp = make_plan(mc, model="qwen3-30b-a3b", mesh="1x8")
    ep = make_plan(mc, model="qwen3-30b-a3b", mesh="1x8", enable_expert_parallel=True)
    assert ep.weight_bytes_per_device == tp.weight_bytes_per_device
    assert ep.replicated_param_bytes == tp.replicated_param_bytes
    main(["--model", "qwen3-30b-a3b", "--mesh", "1x8", "--enable-expert-parallel"])
    assert "8-way tensor parallel, experts expert-parallel" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["--model", "qwen3-8b", "--mesh", "1x8", "--enable-expert-parallel"])
    assert e.value.code == 2
    assert "enable_expert_parallel=True: Qwen3ForCausalLM is a dense model" in \
        capsys.readouterr().err
