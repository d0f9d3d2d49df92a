"""Tiny random transformers checkpoints for tests (written with save_pretrained)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from jaxserve.checkpoints.tiny_tokenizer import make_tiny_tokenizer

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
# Qwen3.5 hybrids, saved as vision-language checkpoints (text under model.language_model):
# 3 Gated DeltaNet layers then 1 gated full-attention layer, twice; partial RoPE.
_HYBRID = dict(
    num_hidden_layers=8, tie_word_embeddings=False, rms_norm_eps=1e-6, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)
_KINDS["qwen3_5"] = dict(_HYBRID)
_KINDS["qwen3_5_moe"] = dict(_HYBRID, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48)
_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
HYBRID_KINDS = ("qwen3_5", "qwen3_5_moe")


def _classes(kind: str):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3_5Config,
                              Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)
    return {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
            "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
            "qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration),
            "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)}[kind]


def model_class(kind: str) -> type:
    """The transformers class that loads a `kind` checkpoint."""
    return _classes(kind)[1]


def make_tiny_model(kind: str, *, seed: int = 0, **config_overrides: Any) -> torch.nn.Module:
    """A float32 tiny random model; every norm weight is randomised (1 + 0.3 randn, or
    0.3 randn for Qwen3.5's (1 + w) norms), and so are the DeltaNet's A_log and dt_bias."""
    if kind not in _KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; known: {', '.join(_KINDS)}")
    config_cls, model_cls = _classes(kind)
    text = {**_BASE, **_KINDS[kind], **config_overrides}
    hybrid = kind in HYBRID_KINDS
    if hybrid and "num_experts" in text:
        text.pop("intermediate_size")
    config = config_cls(text_config=text, vision_config=_VISION) if hybrid else config_cls(**text)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):   # the gated norm: plain w
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:    # input/post_attention/final norms and q_norm/k_norm
                p.copy_((0.0 if hybrid else 1.0) + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):     # decay rates exp(A_log) over two decades
                p.copy_(torch.empty(p.shape).uniform_(-2.0, 2.0, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):   # make routing decisive, not near-uniform
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    return model


def make_tiny_checkpoint(kind: str, path: str | Path, *, dtype: torch.dtype = torch.float32, seed: int = 0,
                         max_shard_size: str | None = None, **config_overrides: Any) -> str:
    """Writes a tiny random `kind` ("llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")
    checkpoint to `path`."""
    model = make_tiny_model(kind, seed=seed, **config_overrides).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    make_tiny_tokenizer(str(path))
    return str(path)


def reference_greedy(path: str | Path, prompts: list[list[int]], num_new: int,
                     kind: str | None = None) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, run alone, never stopping at
    eos (as jaxserve's ignore_eos); `kind` picks the class, else AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM
    cls = model_class(kind) if kind else AutoModelForCausalLM
    model = cls.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new,
                                 do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs
