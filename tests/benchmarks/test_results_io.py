"""benchmarks.shared.results_io: the shared format (strict JSON, Markdown, machine record)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.shared.results_io import (clean, cpu_snapshot, markdown_table, new_figure, other_load,
                                          write_results)


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
    from benchmarks.shared import results_io
    monkeypatch.setattr(results_io, "other_load", lambda start: 1.5)
    paths = write_results(str(tmp_path), "z", benchmark="demo", argv=[], config={},
                          results={}, table="t", notes=["mine"])
    doc = json.loads(Path(paths["json"]).read_text())
    assert doc["notes"][0] == "mine" and doc["notes"][1].startswith("WARNING: other processes")
    assert "1.50 cores" in Path(paths["md"]).read_text()


def bar_plot(path: str) -> None:
    """A real plot through new_figure: it imports matplotlib the way the benchmarks do."""
    plt, fig, (ax,) = new_figure(1)
    ax.bar(["a"], [1.0])
    fig.savefig(path)
    plt.close(fig)


def test_missing_matplotlib_writes_json_and_table_then_warns(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # as if not installed
    (tmp_path / "x.png").write_bytes(b"\x89PNG from an earlier run")
    paths = write_results(str(tmp_path), "x", benchmark="demo", argv=[], config={},
                          results={"v": 1}, table=markdown_table(["k", "v"], [["a", 1]]),
                          plot=bar_plot)
    assert set(paths) == {"json", "md"}
    assert json.loads(Path(paths["json"]).read_text())["results"] == {"v": 1}
    assert not (tmp_path / "x.png").exists()   # the stale figure does not pass for this run
    md = Path(paths["md"]).read_text()
    assert "| a | 1 |" in md and "![x]" not in md
    assert 'x.png not drawn: matplotlib is not installed; `pip install -e ".[bench]"`' in md
    out, err = capsys.readouterr()
    assert "| a | 1 |" in out and "wrote " in out and "x.png" not in out
    assert err.startswith(f"WARNING: plot {tmp_path / 'x.png'} not drawn: matplotlib is not "
                          'installed; pip install -e ".[bench]" installs it')


def test_other_plot_errors_raise_after_the_results_are_written(tmp_path):
    def broken(path: str) -> None:
        raise ModuleNotFoundError("No module named 'seaborn'", name="seaborn")

    with pytest.raises(ModuleNotFoundError, match="seaborn"):
        write_results(str(tmp_path), "w", benchmark="demo", argv=[], config={},
                      results={"v": 2}, table="| t |", plot=broken)
    assert json.loads((tmp_path / "w.json").read_text())["results"] == {"v": 2}
    assert "| t |" in (tmp_path / "w.md").read_text()


def test_a_real_plot_is_drawn_and_linked(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_results(str(tmp_path), "p", benchmark="demo", argv=[], config={},
                          results={}, table="t", plot=bar_plot)
    assert Path(paths["png"]).read_bytes()[:4] == b"\x89PNG"
    assert "![p](p.png)" in Path(paths["md"]).read_text()
