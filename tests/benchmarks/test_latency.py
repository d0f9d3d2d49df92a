"""benchmarks.offline.latency end to end on a tiny Qwen3, with a roofline file: files, fields,
agreement of the batch-1 greedy outputs, TPOT ratio and roofline percentages."""
from __future__ import annotations

import json

import pytest

from benchmarks.offline.latency import main
from benchmarks.shared.model_stats import model_stats
from tests.benchmarks.conftest import assert_figure


def test_latency_with_roofline(tiny_qwen3, tmp_path):
    roofline = tmp_path / "roofline.json"
    roofline.write_text(json.dumps({"benchmark": "roofline", "results": {"best": {
        "copy_gb_per_s": 10.0, "matmul_tflops": 0.1, "device": "cpu:cpu"}}}))
    main(["--model", tiny_qwen3, "--prompt-lens", "8,24,1000", "--tpot-prompt-len", "8",
          "--output-len", "8", "--iters", "2", "--ref-cache", "dynamic",
          "--roofline", str(roofline), "--output-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "latency.json").read_text())
    assert_figure(tmp_path / "latency.png")
    assert "TPOT" in (tmp_path / "latency.md").read_text()
    assert doc["config"]["prompt_lens_run"] == [8, 24]   # 1000 > the model's 256 positions
    assert doc["agreement"]["all_agree"] is True and doc["agreement"]["num_requests"] == 2
    assert doc["ratio"] > 0
    js = doc["results"]["jaxserve"]
    assert set(js["ttft_ms"]) == {"8", "24"} and all(v > 0 for v in js["ttft_ms"].values())
    assert js["tpot_ms"] > 0 and all(len(o) == 8 for o in js["outputs"])
    stats = model_stats(tiny_qwen3)
    bytes_per_step = stats.weight_bytes("float32") + stats.kv_bytes_per_token("float32") * 12
    assert js["tpot_roofline_ms"] * 1e-3 * 10e9 == pytest.approx(bytes_per_step)   # ctx 8 + 8/2
    assert js["tpot_pct_of_roofline"] == pytest.approx(100 * js["tpot_roofline_ms"] / js["tpot_ms"])
    assert set(js["ttft_pct_of_compute_roofline"]) == {"8", "24"}
    md = (tmp_path / "latency.md").read_text()
    assert "TPOT's % is (weight + KV bytes) / copy bandwidth" in md
