"""docs/CONVENTIONS.md holds for the engine and its generic packages (issue 40): a type hint on
every public signature, and `from __future__ import annotations` in every module that
defines a function or class (so hints never need a runtime import)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxserve", "models", "sharding", "pallas_kernels")
FUTURE = "from __future__ import annotations"


def _sources(package: str) -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text())
            for p in sorted((ROOT / package).rglob("*.py"))}


def public_functions(node: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Module-level functions and methods of public classes whose names are public (or
    dunders: __init__, __call__, ...), in classes nested in public classes too; not
    functions nested in functions."""
    out = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef) and not child.name.startswith("_"):
            out += public_functions(child)
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            dunder = child.name.startswith("__") and child.name.endswith("__")
            if dunder or not child.name.startswith("_"):
                out.append(child)
    return out


def unhinted(f: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The parameters (but self / cls) without a hint, and "return" when the return has
    none (__init__'s may go without)."""
    a = f.args
    params = [p for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
    params += [p for p in (a.vararg, a.kwarg) if p is not None]
    out = [p.arg for p in params if p.annotation is None]
    if f.name != "__init__" and f.returns is None:
        out.append("return")
    return out


def missing_hints(package: str) -> list[str]:
    return [f"{path}:{f.lineno} {f.name}: {', '.join(bare)}"
            for path, tree in _sources(package).items()
            for f in public_functions(tree) if (bare := unhinted(f))]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_signature_has_type_hints(package):
    missing = missing_hints(package)
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("package", PACKAGES)
def test_modules_with_code_postpone_their_annotations(package):
    bare = [path for path, tree in _sources(package).items()
            if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                   for n in tree.body)
            and not any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
                        and any(a.name == "annotations" for a in n.names) for n in tree.body)]
    assert not bare, bare


def test_the_scan_sees_a_bare_signature():
    """The checks can fail: a bare parameter, a bare return and a public method are caught;
    self, a hinted __init__ and private or nested functions are not."""
    tree = ast.parse("class A:\n"
                     "    def __init__(self, x: int): ...\n"
                     "    def run(self, y) -> None: ...\n"
                     "    def _private(self, z): ...\n"
                     "class _B:\n"
                     "    def run(self, w): ...\n"
                     "def f(*args, **kw: int):\n"
                     "    def inner(v): ...\n")
    found = {f.name: unhinted(f) for f in public_functions(tree)}
    assert found == {"__init__": [], "run": ["y"], "f": ["args", "return"]}
