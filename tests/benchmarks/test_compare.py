"""benchmarks.offline.compare end to end on a tiny Qwen3: files, fields, agreement, ratio."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.offline.compare import main
from tests.benchmarks.conftest import assert_figure


def check_files(out, name: str) -> dict:
    for ext in ("json", "md"):
        assert (out / f"{name}.{ext}").stat().st_size > 100
    assert_figure(out / f"{name}.png")
    doc = json.loads((out / f"{name}.json").read_text())
    assert doc["benchmark"] == "compare"
    assert doc["command"].startswith("python -m benchmarks.offline.compare")
    m = doc["machine"]
    assert m["cpu"] and m["versions"]["jax"] and m["versions"]["torch"] and m["git"]["commit"]
    return doc


def test_compare_random_workload(tiny_qwen3, tmp_path, capsys):
    got = main(["--model", tiny_qwen3, "--workload", "random", "--num-prompts", "6",
                "--input-len", "12", "--output-len", "10", "--range-ratio", "0.5",
                "--ref-batch-size", "2,4", "--ref-cache", "dynamic", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "16", "--mesh", "1x2", "--repeats", "2",
                "--output-dir", str(tmp_path)])
    doc = check_files(tmp_path, "compare_random")
    assert doc["agreement"]["all_agree"] is True
    assert doc["agreement"]["identical_requests"] == 6
    assert doc["agreement"]["first_mismatch"] is None
    assert isinstance(doc["ratio"], float) and doc["ratio"] > 0 and math.isfinite(doc["ratio"])
    assert doc["ratio"] == got["ratio"]
    res = doc["results"]
    for side in ("jaxserve", "reference"):
        assert res[side]["output_tokens_per_s"] > 0 and res[side]["requests_per_s"] > 0
        assert res[side]["total_tokens_per_s"] > res[side]["output_tokens_per_s"]
    assert [t["batch_size"] for t in res["reference"]["batch_sizes_tried"]] == [4, 2]
    assert res["jaxserve"]["batch"] == 4 and res["reference"]["batch"] in (2, 4)
    assert res["reference"]["cache"] == "dynamic"
    assert res["workload"]["num_prompts"] == 6 and 5 <= res["workload"]["output_len_max"] <= 15
    assert res["jaxserve"]["compiles_during_run"] == 0
    assert res["jaxserve"]["engine_args"]["mesh"] == "1x2"   # tensor parallel over 2 devices
    for side in ("jaxserve", "reference"):   # --repeats 2: both timings kept, median used
        each = res[side]["seconds_each"]
        assert len(each) == 2 and res[side]["seconds"] == pytest.approx(sum(each) / 2)
    assert "median of 2 runs" in (tmp_path / "compare_random.md").read_text()
    assert "| jaxserve |" in capsys.readouterr().out


def test_compare_dummy_weights_batch1(tiny_qwen3, tmp_path):
    """--load-format dummy: a config-only directory gets random weights written once,
    read by both systems; --batch-size 1 runs both one request at a time."""
    cfg_dir = tmp_path / "config-only"
    cfg_dir.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (cfg_dir / f).write_bytes((Path(tiny_qwen3) / f).read_bytes())
    out = tmp_path / "out"
    main(["--model", str(cfg_dir), "--load-format", "dummy", "--workload", "sharegpt-like",
          "--num-prompts", "3", "--max-model-len", "48", "--batch-size", "1",
          "--max-num-batched-tokens", "16", "--ref-threads", "1",
          "--output-dir", str(out)])
    doc = check_files(out, "compare_sharegpt-like_bs1")
    assert doc["config"]["model_info"]["random_weights"] is True
    assert list((out / "weights").iterdir())   # the weights file both systems read
    assert doc["results"]["reference"]["batch"] == 1 and doc["results"]["jaxserve"]["batch"] == 1
    assert doc["results"]["reference"]["torch_threads"] == 1
    assert "mean request latency" in (out / "compare_sharegpt-like_bs1.md").read_text()
    assert doc["agreement"]["all_agree"] is True and doc["ratio"] > 0
    assert doc["results"]["workload"]["distribution"] == "log-normal"
