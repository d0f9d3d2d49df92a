"""benchmarks/ stays in folders by topic: no loose script at the top (the GPU session's
shell entry points stay there), every folder in benchmarks/README.md's table, every
result's command names the module that runs it."""
from __future__ import annotations

import re
from pathlib import Path

from benchmarks.shared.results_io import module_of

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_no_loose_script_at_the_top():
    assert sorted(p.name for p in BENCH.glob("*.py")) == []
    assert {p.name for p in BENCH.glob("*.sh")} >= {"gpu_session.sh", "gpu_wheels.sh"}


def test_every_folder_is_in_the_readme_table():
    table = set(re.findall(r"^\| `(\w+)/`", (BENCH / "README.md").read_text(), re.M))
    folders = {p.name for p in BENCH.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert folders and folders <= table


def test_a_result_names_its_module_by_folder():
    assert module_of("compare") == "benchmarks.offline.compare"
    assert module_of("gpu_session") == "benchmarks.gpu.gpu_session"
    assert module_of("no_such_benchmark") == "benchmarks.no_such_benchmark"
