"""benchmarks/vllm_cpu/vllm_cpu_steps.py at toy size: both variants run in their own
processes, every step is counted in one phase, and the attention-free variant really
runs without attention (its tokens differ from the engine's)."""
from __future__ import annotations

import json

from benchmarks.vllm_cpu import vllm_cpu_steps


def test_both_variants_run_and_the_phases_add_up(tiny_qwen3, tmp_path, capsys):
    out = tmp_path / "steps.json"
    assert vllm_cpu_steps.main([
        "--model", tiny_qwen3, "--dtype", "float32", "--num-prompts", "4", "--input-len", "40",
        "--output-len", "5", "--max-model-len", "128", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "64", "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    runs = {r["variant"]: r for r in doc["runs"]}
    assert list(runs) == ["full", "no_attention"]
    for r in runs.values():
        # 160 prompt tokens in chunks of at most 64, then single-token decode steps
        assert r["prefill_steps"] >= 3 and r["decode_steps"] >= 3
        assert r["steps"] == r["prefill_steps"] + r["decode_steps"]
        assert 0 < r["prefill_s"] + r["decode_s"] <= r["seconds"]
        assert r["compilations_during_run"] == 0 and len(r["first_tokens"]) == 5
    assert runs["full"]["first_tokens"] != runs["no_attention"]["first_tokens"]
    share = doc["summary"]["attention_share"]
    assert set(share) == {"seconds", "prefill_s", "decode_s"}
    assert all(v is None or v < 1 for v in share.values())
    table = capsys.readouterr().out
    assert "| full |" in table and "| no_attention |" in table and "attention's share" in table


def test_the_summary_without_the_second_variant_claims_no_share():
    run = {"variant": "full", "seconds": 2.0, "output_tok_s": 10.0, "prefill_s": 1.0,
           "decode_s": 0.5}
    summ = vllm_cpu_steps.summary([run])
    assert "attention_share" not in summ and summ["medians"]["full"]["seconds"] == 2.0
    half = dict(run, variant="no_attention", seconds=1.0, prefill_s=0.25, decode_s=0.5)
    share = vllm_cpu_steps.summary([run, half])["attention_share"]
    assert share == {"seconds": 0.5, "prefill_s": 0.75, "decode_s": 0.0}
