"""benchmarks.loading.convert_load end to end on a tiny Qwen3 (one mesh, to stay quick): both
ways load the same tree, and the results carry every run, the conversion and the ratio."""
from __future__ import annotations

import json

from benchmarks.loading.convert_load import main, quantizations


def test_convert_load(tiny_qwen3, tmp_path):
    main(["--model", tiny_qwen3, "--dtype", "float32", "--meshes", "1x2", "--repeats", "1",
          "--output-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "convert_load.json").read_text())
    rows = doc["results"]["loads"]
    ways = 2 * (1 + len(quantizations()))
    assert [r["mesh"] for r in rows] == ["1x2"] * ways
    assert [r["loader"] for r in rows[:2]] == ["safetensors", "converted (orbax)"]
    for r in rows:
        assert len(r["runs_s"]) == 1 and r["median_s"] > 0 and r["first_s"] > 0
        assert r["convert_seconds"] > 0 and r["converted_disk_bytes"] > 0
        assert r["param_gib"] == rows[0]["param_gib"] or r["quantization"]
    assert rows[0]["speedup_vs_safetensors"] == 1.0
    assert doc["config"]["model"] == tiny_qwen3 and doc["config"]["repeats"] == 1
    assert "converted (orbax)" in (tmp_path / "convert_load.md").read_text()
    assert not (tmp_path / "convert_load.png").exists()   # a table, no figure
