"""Imports point one way (docs/ARCHITECTURE.md): the generic packages never import the
engine, and the engine's host core imports neither jax nor the engine's device side."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(package: str) -> dict[str, set[str]]:
    """file -> the top-level-qualified modules it imports (relative imports too)."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                names.add("." * node.level + (node.module or ""))
        out[str(path.relative_to(ROOT))] = names
    return out


@pytest.mark.parametrize("package", ["sharding", "models", "pallas_kernels"])
def test_generic_packages_never_import_jaxserve(package):
    bad = {f: sorted(m for m in mods if m.split(".")[0] == "jaxserve")
           for f, mods in imported_modules(package).items()}
    assert not {f: m for f, m in bad.items() if m}


def test_the_host_core_imports_no_device_code():
    forbidden = ("jax", "jaxlib", "flax", "models", "sharding", "pallas_kernels",
                 "jaxserve.runner", "jaxserve.engine", "jaxserve.api", "jaxserve.planning")
    bad = {f: sorted(m for m in mods if any(m == p or m.startswith(p + ".") for p in forbidden))
           for f, mods in imported_modules("jaxserve/core").items()}
    assert not {f: m for f, m in bad.items() if m}
