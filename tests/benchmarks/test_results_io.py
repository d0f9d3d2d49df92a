"""benchmarks.results_io: the shared format (strict JSON, Markdown, machine record)."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.results_io import clean, cpu_snapshot, markdown_table, other_load, write_results


def test_write_results(tmp_path, capsys):
    def plot(path: str) -> None:
        with open(path, "wb") as f:
            f.write(b"\x89PNG fake")

    paths = write_results(str(tmp_path / "out"), "x", benchmark="demo", argv=["--a", "b c"],
                          config={"rate": float("inf")}, results={"v": float("nan")},
                          table=markdown_table(["k", "v"], [["a", 1.23456], ["b", None]]),
                          plot=plot, ratio=2.5, agreement={"all_agree": True})
    doc = json.loads(Path(paths["json"]).read_text())   # strict: no NaN / Infinity tokens
    assert doc["benchmark"] == "demo" and doc["command"] == "python -m benchmarks.demo --a 'b c'"
    assert doc["config"]["rate"] == "inf" and doc["results"]["v"] is None
    assert doc["ratio"] == 2.5 and doc["agreement"] == {"all_agree": True}
    m = doc["machine"]
    assert m["cpu"] and m["versions"]["jax"] and len(m["git"]["commit"]) == 40
    assert len(m["loadavg_start"]) == 3 and len(m["loadavg_end"]) == 3
    assert m["other_processes_cores"] is None or 0 <= m["other_processes_cores"] <= m["cpu_count"]
    md = Path(paths["md"]).read_text()
    assert "| a | 1.23 |" in md and "| b | n/a |" in md and "![x](x.png)" in md
    assert "| a | 1.23 |" in capsys.readouterr().out


def test_no_plot_no_png(tmp_path):
    paths = write_results(str(tmp_path), "y", benchmark="demo", argv=[], config={},
                          results={}, table="t")
    assert set(paths) == {"json", "md"} and not (tmp_path / "y.png").exists()
    assert json.loads(Path(paths["json"]).read_text())["ratio"] is None


def test_other_load_counts_other_processes_only():
    # 2 s of wall time: the machine was busy 3 CPU-seconds, 1 of them this process's
    assert other_load((100.0, 10.0, 50.0), (103.0, 11.0, 52.0)) == 1.0
    assert other_load((100.0, 10.0, 50.0), (101.0, 11.0, 52.0)) == 0.0   # all ours
    assert other_load(None) is None
    assert other_load((100.0, 10.0, 50.0), (101.0, 10.0, 50.5)) is None   # too short to tell
    busy, ours, wall = cpu_snapshot()
    assert busy >= ours >= 0 and wall > 0


def test_clean_nested():
    assert clean({1: (float("-inf"), [float("nan")])}) == {"1": ["-inf", [None]]}


def test_a_disturbed_run_is_flagged(tmp_path, monkeypatch):
    from benchmarks import results_io
    monkeypatch.setattr(results_io, "other_load", lambda start: 1.5)
    paths = write_results(str(tmp_path), "z", benchmark="demo", argv=[], config={},
                          results={}, table="t", notes=["mine"])
    doc = json.loads(Path(paths["json"]).read_text())
    assert doc["notes"][0] == "mine" and doc["notes"][1].startswith("WARNING: other processes")
    assert "1.50 cores" in Path(paths["md"]).read_text()
