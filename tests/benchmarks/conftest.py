"""A tiny random Qwen3 shared by the benchmark smoke tests (written once per session)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from benchmarks.shared.common import make_qwen3

# initializer_range 0.2 rather than 0.02: greedy outputs then vary token to token, so
# an agreement check between two systems compares something (0.02 repeats one token).
TINY_QWEN3 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, tie_word_embeddings=True, initializer_range=0.2)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return make_qwen3(str(tmp_path_factory.mktemp("tiny-qwen3")), TINY_QWEN3, seed=0)


def assert_figure(path: Path) -> None:
    """The PNG a benchmark drew. Without matplotlib (the `test` extra brings it) there is
    none, and the rest of the benchmark's files must still be there."""
    if importlib.util.find_spec("matplotlib") is None:
        assert not path.exists()
    else:
        assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
