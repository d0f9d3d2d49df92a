"""benchmarks.shared.checkpoint: which directory both systems load."""
from __future__ import annotations

import pytest

from benchmarks.shared.checkpoint import default_dtype, prepare, resolve


def test_directory_is_used_as_is(tiny_qwen3, tmp_path):
    assert resolve(tiny_qwen3) == tiny_qwen3
    path, info = prepare(tiny_qwen3, "auto", "float32", str(tmp_path))
    assert path == tiny_qwen3 and info["random_weights"] is False
    assert not list(tmp_path.iterdir())   # nothing written for a real checkpoint


def test_config_only_directory_needs_dummy(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="load-format dummy"):
        prepare(str(tmp_path), "auto", "float32", str(tmp_path / "w"))
    with pytest.raises(ValueError, match="auto or dummy"):
        prepare(str(tmp_path), "pt", "float32", str(tmp_path / "w"))


def test_default_dtype():
    assert default_dtype("auto", "cuda") == "bfloat16"
    assert default_dtype("auto", "cpu") == "float32"
    assert default_dtype("float16", "cpu") == "float16"
