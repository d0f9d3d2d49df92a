"""Tiny random transformers checkpoints for tests (written with save_pretrained)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from jaxserve.tiny_tokenizer import make_tiny_tokenizer

# Small but non-trivial: GQA (4 q heads / 2 kv heads), several layers, llama3 RoPE scaling.
_BASE: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,   # the tiny tokenizer's ids
)
_KINDS: dict[str, dict[str, Any]] = {
    "llama": dict(
        num_hidden_layers=4, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    ),
    "qwen3": dict(
        num_hidden_layers=4, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3_moe": dict(
        num_hidden_layers=2, tie_word_embeddings=False, rms_norm_eps=1e-6,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}


def _classes(kind: str):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)
    return {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
            "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}[kind]


def make_tiny_model(kind: str, *, seed: int = 0, **config_overrides: Any) -> torch.nn.Module:
    """A float32 tiny random model; every norm weight is randomised (1 + 0.3 randn)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; known: {', '.join(_KINDS)}")
    config_cls, model_cls = _classes(kind)
    config = config_cls(**{**_BASE, **_KINDS[kind], **config_overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:      # input/post_attention/final norms and q_norm/k_norm
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):   # make routing decisive, not near-uniform
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    return model


def make_tiny_checkpoint(kind: str, path: str | Path, *, dtype: torch.dtype = torch.float32, seed: int = 0,
                         max_shard_size: str | None = None, **config_overrides: Any) -> str:
    """Writes a tiny random `kind` ("llama", "qwen3", "qwen3_moe") checkpoint to `path`."""
    model = make_tiny_model(kind, seed=seed, **config_overrides).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    make_tiny_tokenizer(str(path))
    return str(path)
