"""benchmarks.quant.quantization at toy size, each part on one tiny llama (head_dim 128, lane-
aligned on TPU as a served model's). The accuracy and speed parts build engines with the
same settings (max_model_len 48, 8 rows), so the second part's warmup finds the first's
programs in the persistent compilation cache."""
from __future__ import annotations

import json

import pytest

from benchmarks.quant.quantization import main
from tests.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("qbench"),
                                num_attention_heads=8, num_key_value_heads=4,
                                intermediate_size=256, head_dim=128)


def run(out, *argv: str) -> dict:
    main([*argv, "--output-dir", str(out)])
    return json.loads((out / "quantization.json").read_text())["results"]


def test_memory_planner_and_compiler(tiny, tmp_path):
    pytest.importorskip("libtpu")
    res = run(tmp_path, "--parts", "memory", "--memory-model", tiny, "--max-model-len", "256",
              "--memory-schemes", "none/auto,fp8/fp8", "--step-schemes", "none/auto,fp8/fp8")
    res = res["memory"]
    rows = {(r["weights"], r["kv"]): r for r in res["rows"]}
    base, fp8 = rows["none", "auto"]["planner"], rows["fp8", "fp8"]["planner"]
    assert fp8["weight_bytes_per_device"] < base["weight_bytes_per_device"]
    # float32 KV (the tiny model's dtype) vs a byte per element: 4x the tokens per byte
    assert base["kv_bytes_per_token_per_device"] == 4 * fp8["kv_bytes_per_token_per_device"]
    assert fp8["kv_tokens"] > base["kv_tokens"]
    for r in res["rows"]:
        c = r["compiler"]
        assert c["compiled"] and c["error"] is None and c["compile_seconds"] > 0
        # what the compiler says the forward takes = the planner's weights + KV, to 1 %
        assert c["argument_bytes"] == pytest.approx(r["planner"]["planner_bytes_per_device"],
                                                    rel=0.01)
    steps = {(s["weights"], s["kv"]): s for s in res["steps"]}
    assert steps["fp8", "fp8"]["bytes_accessed"] < steps["none", "auto"]["bytes_accessed"]
    assert steps["none", "auto"]["flops"] > 0 and steps["none", "auto"]["tokens"] == 16
    assert "gemma-4-31b" in res["missing"]
    md = (tmp_path / "quantization.md").read_text()
    assert "gemma-4-31b" in md and "planner - compiler" in md


def test_accuracy_then_speed(tiny, tmp_path):
    acc = run(tmp_path, "--parts", "accuracy", "--accuracy-models", tiny,
              "--accuracy-schemes", "int8/int8", "--num-prompts", "4", "--prompt-len", "32")
    (row,) = acc["accuracy"]["rows"]
    assert row["positions"] == 4 * 31
    assert 0.0 <= row["top1_agreement"] <= 1.0
    assert 0.0 < row["mean_abs_dlogprob"] <= row["max_abs_dlogprob"] < 0.5
    base = acc["accuracy"]["baselines"][tiny]
    assert 0.0 < base["mean_top1_prob"] <= 1.0 and base["nll"] > 0

    speed = run(tmp_path, "--parts", "speed", "--speed-model", tiny, "--speed-schemes",
                "none/auto,int8/int8", "--speed-prompts", "8", "--speed-prompt-len", "16",
                "--speed-output-len", "16", "--repeats", "1",
                "--speed-tpu-target", "")["speed"]
    none, q = speed["rows"]
    assert none["ratio_vs_first"] == 1.0 and q["ratio_vs_first"] > 0
    for r in (none, q):
        assert r["output_tok_s"] > 0 and r["steps"] >= 16 and r["compiles_during_run"] == 0
    assert speed["engine"]["max_model_len"] == 48   # the accuracy part's, as the docstring says
