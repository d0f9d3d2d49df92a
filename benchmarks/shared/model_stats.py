"""Sizes that set a model's roofline: parameters, weight bytes, KV bytes per token."""
from __future__ import annotations

import os
from dataclasses import dataclass

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelStats:
    params: int                 # every stored parameter
    embedding_params: int       # the input embedding (a lookup, not a matmul)
    tied: bool                  # lm_head is the embedding
    num_layers: int
    kv_heads: int
    head_dim: int

    def weight_bytes(self, dtype: str) -> int:
        return self.params * ITEMSIZE[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * ITEMSIZE[dtype]

    def matmul_flops_per_token(self) -> int:
        """2 per multiply-add of every weight a token meets (attention scores left out);
        a tied embedding counts once, as the lm_head."""
        return 2 * (self.params if self.tied else self.params - self.embedding_params)

    def decode_bytes(self, dtype: str, context: float) -> float:
        """Bytes one batch-1 decode step must read: all weights and the KV of `context`."""
        return self.weight_bytes(dtype) + self.kv_bytes_per_token(dtype) * context


def model_stats(path: str) -> ModelStats:
    """From config.json and the safetensors headers (no tensor is read)."""
    from safetensors import safe_open
    from benchmarks.shared.checkpoint import read_config
    cfg = read_config(path)
    params = embed = 0
    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(path, name), framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                params += n
                embed += n if key.endswith("embed_tokens.weight") else 0
    heads = cfg["num_attention_heads"]
    return ModelStats(params=params, embedding_params=embed,
                      tied=bool(cfg.get("tie_word_embeddings", False)),
                      num_layers=cfg["num_hidden_layers"],
                      kv_heads=cfg.get("num_key_value_heads", heads),
                      head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads)
