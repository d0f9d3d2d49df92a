"""Imports point one way (docs/ARCHITECTURE.md): the generic packages never import the
engine; the engine's host core imports neither jax nor the engine's device side; jaxserve's
units import only down its layers, with no circle; its files and functions (and
benchmarks/') stay small and an import inside a function says why it is late."""
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
                 "jaxserve.runner", "jaxserve.engine", "jaxserve.api", "jaxserve.planning",
                 "jaxserve.build", "jaxserve.cli")
    bad = {f: sorted(m for m in mods if any(m == p or m.startswith(p + ".") for p in forbidden))
           for f, mods in imported_modules("jaxserve/core").items()}
    assert not {f: m for f, m in bad.items() if m}


# ---- the engine's layers (docs/ARCHITECTURE.md, "Layers") ----------------------------------
# jaxserve's packages and top-level modules, bottom to top: each may import its own layer
# and the layers below, never one above; no two units import each other, even in a layer.
LAYERS = (
    {"errors", "json_limits"},                                # imports nothing of jaxserve
    {"structured_outputs", "sampling_params", "inputs", "lora_request"},   # request data
    {"config", "checkpoints"},                                # settings, where models are
    {"multimodal"},                                           # images in (host only)
    {"core"},                                                 # host-only scheduling
    {"runner"},                                               # device step
    {"build"},                                                # config -> parts
    {"engine"},                                               # the loop and its front doors
    {"planning", "bench", "api"},                             # over the engine
    {"cli", "console", "generate", "convert", "plan"},        # entry points (old paths)
)
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}
# `python -m jaxserve.api` (a command path kept on purpose) runs the server's command,
# one layer up; the other old command paths are units of the entry points' layer.
ALIASES = {"jaxserve/api/__main__.py"}
# The packages whose files this test holds to the size limits (api/ has its own owner).
SIZED = ("core", "runner", "build", "engine", "planning", "config", "cli", "checkpoints",
         "bench", "multimodal")
# Held to the size limits too, not to the late-import rule (a benchmark imports jax, the
# engine and the libraries it compares late on purpose: after its flags are set).
SIZED_OUTSIDE = ("benchmarks",)
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80


def _unit(module: str) -> str | None:
    """jaxserve.X.Y -> X (a package or a top-level module); None outside jaxserve or for
    the (lazy) package itself."""
    parts = module.split(".")
    if parts[0] != "jaxserve" or len(parts) == 1:
        return None
    return parts[1]


def _imports(path: Path) -> list[str]:
    """Every jaxserve module a file imports, at any depth (functions, TYPE_CHECKING),
    relative imports resolved; `from jaxserve import X` names X's module (__init__'s
    lazy exports)."""
    import jaxserve
    rel = path.relative_to(ROOT).with_suffix("").parts
    package = list(rel[:-1]) if rel[-1] != "__init__" else list(rel[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            if base == "jaxserve":
                out += [jaxserve._EXPORTS.get(a.name, f"jaxserve.{a.name}") for a in node.names]
            else:
                out.append(base)
    return out


def _unit_edges() -> dict[tuple[str, str], list[str]]:
    """(importer's unit, imported unit) -> the files behind the arrow, aliases left out."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted((ROOT / "jaxserve").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        src = _unit("jaxserve." + ".".join(path.relative_to(ROOT / "jaxserve")
                                           .with_suffix("").parts))
        if src is None or src == "__init__" or rel in ALIASES:
            continue
        for module in _imports(path):
            dst = _unit(module)
            if dst is not None and dst != src:
                edges.setdefault((src, dst), []).append(rel)
    return edges


def test_every_unit_of_jaxserve_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in (ROOT / "jaxserve").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert units == set(LAYER), "a unit of jaxserve/ without a layer (or a layer without it)"


def test_imports_point_only_down_the_layers():
    up = {f"{a} -> {b}": files for (a, b), files in _unit_edges().items()
          if LAYER[b] > LAYER[a]}
    assert not up


def test_no_import_circle_between_packages():
    edges = _unit_edges()
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    circles = sorted(f"{a} -> {b} -> ... -> {a}" for a, b in edges if reaches(b, a))
    assert not circles


def test_the_old_paths_are_the_modules_they_name():
    import importlib
    for old, new in (("jaxserve.generate", "jaxserve.cli.generate"),
                     ("jaxserve.convert", "jaxserve.cli.convert"),
                     ("jaxserve.console", "jaxserve.cli.main")):
        assert importlib.import_module(old) is importlib.import_module(new)


def _sized_files() -> list[Path]:
    return sorted([p for pkg in SIZED for p in (ROOT / "jaxserve" / pkg).rglob("*.py")]
                  + list((ROOT / "jaxserve").glob("*.py")))


def _limited_files() -> list[Path]:
    return _sized_files() + sorted(p for top in SIZED_OUTSIDE for p in (ROOT / top).rglob("*.py"))


def test_files_stay_small():
    big = {str(p.relative_to(ROOT)): n for p in _limited_files()
           if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not big


def test_functions_stay_short():
    long = {}
    for path in _limited_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = n
    assert not long


def test_imports_inside_functions_say_why_they_are_late():
    """An import inside a function hides a dependency: only one that must be lazy (a heavy
    or optional library, jax before its settings are made) stays there, with a comment on
    its block of imports (one blank line apart at most) or on the line above it."""
    silent = []
    for path in _sized_files():
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            nodes = sorted((n for n in ast.iter_child_nodes(fn) if isinstance(
                n, (ast.Import, ast.ImportFrom))), key=lambda n: n.lineno)
            nodes += [n for child in ast.iter_child_nodes(fn) if not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(child)
                if isinstance(n, (ast.Import, ast.ImportFrom)) and n not in nodes]
            blocks: list[list[ast.stmt]] = []
            for node in sorted(nodes, key=lambda n: n.lineno):
                if blocks and node.lineno <= blocks[-1][-1].end_lineno + 2:
                    blocks[-1].append(node)
                else:
                    blocks.append([node])
            for block in blocks:
                text = lines[block[0].lineno - 2:block[-1].end_lineno]
                said = text[0].strip().startswith("#") or any("#" in t for t in text[1:])
                if not said:
                    silent.append(f"{path.relative_to(ROOT)}:{block[0].lineno}")
    assert not silent
