"""The built-in default model: a tiny random-weight Qwen3 with a bundled tokenizer.

It lets `python -m jaxserve.api` (or `LLM(model=None)`) run on a fresh machine
with no checkpoint at all. Its weights are random (`load_format="dummy"`), so
its output is random text; only config.json and the tokenizer files are
written, generated on first use under ~/.cache/jaxserve.
"""
from __future__ import annotations

import json
import os

DEFAULT_MODEL_NAME = "jaxserve-tiny-random"

_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 256,                 # the tiny tokenizer's vocabulary
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
}


def cache_root() -> str:
    """Where jaxserve writes generated models: $JAXSERVE_CACHE or ~/.cache/jaxserve."""
    return os.environ.get("JAXSERVE_CACHE") or os.path.expanduser("~/.cache/jaxserve")


def default_model_dir(root: str | None = None) -> str:
    """Directory of the default model, written on first use."""
    root = root or cache_root()
    path = os.path.join(root, DEFAULT_MODEL_NAME)
    if not os.path.exists(os.path.join(path, "tokenizer_config.json")):
        # (tokenizers and transformers load only to make the tiny model once)
        from jaxserve.checkpoints.tiny_tokenizer import make_tiny_tokenizer
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(_CONFIG, f, indent=2)
        make_tiny_tokenizer(path, vocab_size=_CONFIG["vocab_size"])
    return path
