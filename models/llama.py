"""Llama and Qwen3 decoders (one code path; Qwen3 = config.qk_norm on).

API the runner relies on:
    hidden, kv_caches = model.apply({"params": p}, kv_caches, inputs)   # [T, E], list per layer
    logits = model.apply({"params": p}, hidden_rows, method="compute_logits")  # float32 [N, V]
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.inputs import ModelInputs
from models.layers import MLP, Attention, Einsum, Embed, RMSNorm

Dtype = Any


class DecoderLayer(nn.Module):
    config: ModelConfig
    mlp_cls: type = MLP          # MLP or a mixture-of-experts block with the same call signature
    dtype: Dtype = jnp.float32
    attention_backend: str = "reference"

    @nn.compact
    def __call__(self, x: jax.Array, cache: jax.Array, inputs: ModelInputs) -> tuple[jax.Array, jax.Array]:
        cfg, dt = self.config, self.dtype
        h = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, cfg.norm_plus_one, name="input_layernorm")(x)
        a, cache = self.token_mixer(h, cache, inputs)
        x = x + a
        h = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, cfg.norm_plus_one,
                    name="post_attention_layernorm")(x)
        x = x + self.mlp_cls(cfg, dt, name="mlp")(h)
        return x, cache

    def token_mixer(self, h: jax.Array, cache: Any, inputs: ModelInputs) -> tuple[jax.Array, Any]:
        return Attention(self.config, self.dtype, self.attention_backend, name="self_attn")(h, cache, inputs)


class LlamaForCausalLM(nn.Module):
    config: ModelConfig
    dtype: Dtype = jnp.float32
    attention_backend: str = "reference"   # see pallas_kernels.ragged_paged_attention.backend_options

    def mlp_cls_for(self, layer_idx: int) -> type:
        return MLP

    def layer_for(self, layer_idx: int) -> nn.Module:
        return DecoderLayer(self.config, self.mlp_cls_for(layer_idx), self.dtype, self.attention_backend)

    def setup(self) -> None:
        cfg = self.config
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, self.dtype)
        # A Python loop over layers: simple, and each layer owns one cache (a KV cache, or
        # a linear-attention layer's state).
        self.layers = [self.layer_for(i) for i in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.dtype, cfg.norm_plus_one)
        if not cfg.tie_word_embeddings:
            self.lm_head = Einsum("TE,EV->TV", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                                  dtype=self.dtype, out_dtype=jnp.float32)

    def __call__(self, kv_caches: list[Any], inputs: ModelInputs) -> tuple[jax.Array, list[Any]]:
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"expected {self.config.num_layers} KV caches (one per layer), got {len(kv_caches)}")
        x = self.embed_tokens(inputs.token_ids)
        new_caches = []
        for layer, cache in zip(self.layers, kv_caches):
            x, cache = layer(x, cache, inputs)
            new_caches.append(cache)
        x = self.norm(x)
        if self.is_initializing():   # so that init creates the lm_head parameters too
            self.compute_logits(x)
        return x, new_caches

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """[N, E] final-normed hidden rows -> float32 logits [N, V]."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(hidden)
        return self.lm_head(hidden)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Same decoder; q_norm/k_norm come from config.qk_norm (set for Qwen3 configs)."""
