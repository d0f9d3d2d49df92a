"""Each model family owns its facts (models/family.py): no code outside models/ asks which
family a model is, and models/ and sharding/ keep their files and functions small."""
from __future__ import annotations

import ast
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from jaxserve.checkpoints.model_configs import BUILTIN_CONFIGS
from models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from models.family import FAMILIES, GEMMA4, QWEN3_MOE, family_of
from models.registry import ARCHITECTURES

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = ("jaxserve", "sharding", "pallas_kernels")
# Whole-model predicates naming a family (or a family's kind); a model answers per layer
# (layer_type, linear_attention_layers, is_moe_layer) or through its family's interface.
FAMILY_PREDICATES = ("is_gemma4", "is_hybrid", "is_moe")
# models/family.py's names for one family or for the set of them.
FAMILY_NAMES = tuple(f.name.upper() for f in FAMILIES) + ("FAMILIES", "GEMMA4_ARCHS", "HYBRID_ARCHS")
# Fields whose value names a family.
NAMING_FIELDS = ("architecture", "architectures", "model_type")


def _names_family(node: ast.AST) -> bool:
    """`node` reads a field whose value names a family (x.architecture, d["model_type"],
    d.get("architectures"), a variable so named)."""
    if isinstance(node, ast.Attribute):
        return node.attr in NAMING_FIELDS or (node.attr == "name" and _is_family(node.value))
    if isinstance(node, ast.Name):
        return node.id in NAMING_FIELDS
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and key.value in NAMING_FIELDS
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        first = node.args[0]
        return (node.func.attr == "get" and isinstance(first, ast.Constant)
                and first.value in NAMING_FIELDS)
    return False


def _is_family(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "family"


def family_checks(source: str) -> list[str]:
    """What in `source` asks which family a model is: a family predicate, a comparison of
    a family-naming field, or models.family's names of a family."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in FAMILY_PREDICATES:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Compare) and any(
                _names_family(x) for x in (node.left, *node.comparators)):
            found.append(f"{node.lineno}: compares {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("models."):
            bad = [a.name for a in node.names if a.name in FAMILY_NAMES]
            if bad:
                found.append(f"{node.lineno}: imports {', '.join(bad)}")
    return found


def _files(*roots: str) -> list[Path]:
    return [p for r in roots for p in sorted((ROOT / r).rglob("*.py"))]


def test_the_scan_finds_each_kind_of_family_check():
    leaks = family_checks(
        "from models.family import GEMMA4\n"
        "a = mc.is_gemma4\n"
        "b = cfg.is_moe or cfg.is_hybrid\n"
        "c = mc.architecture == 'Gemma4ForCausalLM'\n"
        "d = d['model_type'] in ('qwen3',)\n"
        "e = d.get('architectures') != []\n"
        "f = mc.family.name == 'gemma4'\n")
    assert len(leaks) == 8, leaks
    assert not family_checks("w = mc.family.activation_width(mc, 2)\n"
                             "x = mc.linear_attention_layers and mc.is_moe_layer(3)\n"
                             "log(mc.architecture)\n")


def test_no_family_check_outside_models():
    leaks = {}
    for path in _files(*OUTSIDE):
        found = family_checks(path.read_text())
        if found:
            leaks[str(path.relative_to(ROOT))] = found
    assert leaks == {}


def _long_functions(path: Path, limit: int) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > limit]


@pytest.mark.parametrize("root", ["models", "sharding"])
def test_files_and_functions_stay_small(root):
    files = _files(root)
    assert files
    assert {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text().splitlines())) > 450} == {}
    assert {str(p.relative_to(ROOT)): f for p in files if (f := _long_functions(p, 80))} == {}


def test_the_gpu_attention_kernel_module_is_split():
    """pallas_kernels' Hopper attention: its files within the limit (the kernel body
    itself may run long)."""
    for path in (ROOT / "pallas_kernels" / "ragged_paged_attention").glob("gpu*.py"):
        assert len(path.read_text().splitlines()) <= 450, path.name


def test_every_architecture_has_one_family_and_one_model_class():
    counts = Counter(a for f in FAMILIES for a in f.architectures)
    assert set(counts) == set(SUPPORTED_ARCHITECTURES) == set(ARCHITECTURES)
    assert max(counts.values()) == 1
    for f in FAMILIES:
        assert len({ARCHITECTURES[a] for a in f.architectures}) == 1, f.name
        assert all(family_of(a) is f for _, a in f.model_types)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: .*LlamaForCausalLM"):
        family_of("GPT2LMHeadModel")


def test_model_axis_dims_follow_the_family():
    """Gemma 4's MoE layers keep their dense MLP, so its width must divide M; a Qwen3-MoE
    whose every layer is sparse has none to divide; one dense layer brings it back."""
    gemma = ModelConfig.from_hf_dict(BUILTIN_CONFIGS["gemma-4-26b-a4b"])
    qwen = ModelConfig.from_hf_dict(BUILTIN_CONFIGS["qwen3-30b-a3b"])
    assert gemma.family is GEMMA4 and gemma.num_experts and qwen.family is QWEN3_MOE
    dims = lambda mc, ep=False: dict(mc.family.model_axis_dims(mc, ep))
    assert dims(gemma)["intermediate_size"] == gemma.intermediate_size
    assert "intermediate_size" not in dims(qwen)
    assert "intermediate_size" in dims(replace(qwen, mlp_only_layers=(0,)))
    assert dims(qwen, True)["num_experts"] == qwen.num_experts
    assert "moe_intermediate_size" not in dims(qwen, True)
    hybrid = ModelConfig.from_hf_dict(BUILTIN_CONFIGS["qwen3.6-27b"])
    assert dims(hybrid)["linear_num_key_heads"] == hybrid.linear_num_key_heads
    assert "linear_num_key_heads" not in dims(qwen)


def test_activation_width_counts_gemma4s_dense_mlp_beside_the_experts():
    gemma = ModelConfig.from_hf_dict(BUILTIN_CONFIGS["gemma-4-26b-a4b"])
    dense = max(gemma.mlp_width(i) for i in range(gemma.num_layers))
    without = replace(GEMMA4, experts_beside_dense_mlp=False)
    for m in (1, 2, 4):
        assert GEMMA4.activation_width(gemma, m) - without.activation_width(gemma, m) in (
            2 * dense // m, 2 * dense // m + 1)
