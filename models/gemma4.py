"""Gemma 4 (text model of Gemma4ForCausalLM / Gemma4ForConditionalGeneration).

The Llama skeleton (models/llama.py: embeddings, layers looped or scanned, final norm,
tied logits) with Gemma's decoder layer:
  - attention: sliding-window layers (head_dim, KV heads, RoPE theta 1e4) and global
    layers (their own head dim and KV heads, "proportional" RoPE); q_norm / k_norm and a
    weightless v_norm, attention scale 1; global layers of the 26B / 31B take V from
    k_proj (attention_k_eq_v). Sliding layers read and write the sliding KV group
    (models/layer_stack.KV_SLIDING), global ones the global group (KV); the last
    num_kv_shared_layers layers (E2B / E4B) write nothing and read their source layer's.
  - four norms around attention and MLP (plain w, applied in float32), a GeGLU MLP
    (double-wide on KV-sharing layers when use_double_wide_mlp), and on the 26B a
    128-expert MoE block in parallel with the dense MLP, each with its own norms;
  - per-layer embeddings (E2B / E4B): a second embedding, projected and normed, gives
    every layer a small extra input added through a gated projection;
  - the residual scaled by the stored layer_scalar.
Embeddings are scaled by sqrt(hidden) in the model dtype; final logits soft-capped.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import SLIDING_ATTENTION, ModelConfig
from models.inputs import ModelInputs, merge_image_embeds
from models.layer_stack import KV_KIND, KV_SCALES, per_layer
from models.layers import (MLP, Einsum, Embed, RMSNorm, activation, apply_rope, kv_heads_axis,
                           logical_param, paged_attention, rope_inv_freq, rope_tables)
from models.llama import LlamaForCausalLM
from models.qwen3_moe import Experts, routed_experts

Dtype = Any
# The per-layer embeddings, [L, T, P], riding with the caches (models/llama.py).
PER_LAYER_INPUTS = "per_layer_inputs"


def _norm(cfg: ModelConfig, dim: int, dtype: Dtype, name: str | None = None,
          use_weight: bool = True) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, dtype, weight_f32=True, use_weight=use_weight, name=name)


class Gemma4Attention(nn.Module):
    config: ModelConfig
    layer_idx: int
    dtype: Dtype = jnp.float32
    attention_backend: str = "reference"

    @nn.compact
    def __call__(self, x: jax.Array, cache: jax.Array | None, inputs: ModelInputs,
                 first_page: Any = 0, kv_scale: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array | None]:
        cfg, dt, i = self.config, self.dtype, self.layer_idx
        E, N, wq = cfg.hidden_size, cfg.num_heads, cfg.weight_quant
        H, K = cfg.layer_head_dim(i), cfg.layer_num_kv_heads(i)
        sliding = cfg.layer_type(i) == SLIDING_ATTENTION
        if sliding:
            inv_freq = rope_inv_freq(H, cfg.sliding_rope_theta, None)
        else:
            inv_freq = rope_inv_freq(H, cfg.rope_theta, cfg.rope_scaling)
        bias = cfg.attention_bias
        q = Einsum("TE,ENH->TNH", (E, N, H), ("embed", "heads", "head_dim"), 1, bias, dt,
                   quant=wq, name="q_proj")(x)
        tables = rope_tables(inputs.positions, inv_freq)
        q = apply_rope(_norm(cfg, H, dt, "q_norm")(q), tables)
        k = v = None
        if not cfg.is_kv_shared(i):
            kv_axes = ("embed", kv_heads_axis(cfg, i), "head_dim")
            k = Einsum("TE,EKH->TKH", (E, K, H), kv_axes, 1, bias, dt, quant=wq, name="k_proj")(x)
            v = k if cfg.attention_k_eq_v and not sliding else \
                Einsum("TE,EKH->TKH", (E, K, H), kv_axes, 1, bias, dt, quant=wq, name="v_proj")(x)
            k = apply_rope(_norm(cfg, H, dt, "k_norm")(k), tables)
            v = _norm(cfg, H, dt, "v_norm", use_weight=False)(v)
        if cache is None:   # init: parameter shapes only
            o = q
        else:
            o, cache = paged_attention(q, k, v, cache, inputs, first_page, sm_scale=1.0,
                                       backend=self.attention_backend, kv_scale=kv_scale,
                                       sliding_window=cfg.sliding_window if sliding else None,
                                       horizon=inputs.image_horizon if sliding else None)
        out = Einsum("TNH,NHE->TE", (N, H, E), ("heads", "head_dim", "embed"), 2, bias, dt,
                     quant=wq, name="o_proj")(o)
        return out, cache


class Gemma4Router(nn.Module):
    """Top-k experts of each token: softmax over the experts of proj(norm(x) * scale /
    sqrt(E)) in float32, the top k renormalised, then each scaled by its expert's own
    per_expert_scale."""
    config: ModelConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg, dt = self.config, self.dtype
        E, X = cfg.hidden_size, cfg.num_experts
        scale = logical_param(self, "scale", nn.initializers.ones, (E,), ("norm",), dt)
        per_expert = logical_param(self, "per_expert_scale", nn.initializers.ones, (X,), (None,), dt)
        h = _norm(cfg, E, dt, "norm", use_weight=False)(x) * scale * jnp.asarray(E ** -0.5, dt)
        logits = Einsum("TE,EX->TX", (E, X), ("embed", None), dtype=dt, name="proj")(h)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        top_w, top_i = jax.lax.top_k(probs, cfg.num_experts_per_tok)
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
        return (top_w * per_expert[top_i].astype(jnp.float32)).astype(x.dtype), top_i


class Gemma4DecoderLayer(nn.Module):
    config: ModelConfig
    dtype: Dtype = jnp.float32
    attention_backend: str = "reference"
    layer_idx: int = 0   # its kind; a scanned block's j serves j + k * period

    @nn.compact
    def __call__(self, x: jax.Array, caches: dict[str, Any], inputs: ModelInputs,
                 cache_index: Any, layer_index: Any = None) -> tuple[jax.Array, dict[str, Any]]:
        cfg, dt, i = self.config, self.dtype, self.layer_idx
        E = cfg.hidden_size
        kind = KV_KIND[cfg.layer_type(i)]
        cache = caches.get(kind)   # absent from init's placeholder
        first_page = 0 if cache is None else cache_index * per_layer(cache, cfg, cfg.layer_type(i))
        rider = KV_SCALES[kind][1]
        kv_scale = caches[rider][cache_index] if rider in caches else None
        a, cache = Gemma4Attention(cfg, i, dt, self.attention_backend, name="self_attn")(
            _norm(cfg, E, dt, "input_layernorm")(x), cache, inputs, first_page, kv_scale)
        if cache is not None:
            caches = {**caches, kind: cache}
        x = x + _norm(cfg, E, dt, "post_attention_layernorm")(a)

        h = MLP(cfg, dt, cfg.mlp_width(i), name="mlp")(_norm(cfg, E, dt, "pre_feedforward_layernorm")(x))
        if cfg.is_moe:   # the experts run beside the dense MLP, on the same residual
            top_w, top_i = Gemma4Router(cfg, dt, name="router")(x)
            experts_in = _norm(cfg, E, dt, "pre_feedforward_layernorm_2")(x)
            routed = routed_experts(cfg, dt, experts_in, top_w, top_i,
                                    Experts(cfg, dt, name="experts")())
            h = (_norm(cfg, E, dt, "post_feedforward_layernorm_1")(h)
                 + _norm(cfg, E, dt, "post_feedforward_layernorm_2")(routed))
        x = x + _norm(cfg, E, dt, "post_feedforward_layernorm")(h)

        if cfg.hidden_size_per_layer_input:
            P = cfg.hidden_size_per_layer_input
            gate = Einsum("TE,EP->TP", (E, P), ("embed", None), dtype=dt,
                          name="per_layer_input_gate")(x)
            extra = (activation(cfg)(gate) * caches[PER_LAYER_INPUTS][layer_index]
                     if PER_LAYER_INPUTS in caches else gate)   # init: shapes only
            extra = Einsum("TP,PE->TE", (P, E), (None, "embed"), dtype=dt,
                           name="per_layer_projection")(extra)
            x = x + _norm(cfg, E, dt, "post_per_layer_input_norm")(extra)
        scalar = logical_param(self, "layer_scalar", nn.initializers.ones, (1,), (None,), dt)
        return x * scalar, caches


class Gemma4ForCausalLM(LlamaForCausalLM):
    """Also serves Gemma4ForConditionalGeneration (its text model)."""

    @classmethod
    def make_layer(cls, config: ModelConfig, dtype: Dtype, attention_backend: str, layer_idx: int,
                   **kw: Any) -> Gemma4DecoderLayer:
        return Gemma4DecoderLayer(config, dtype, attention_backend, layer_idx=layer_idx, **kw)

    def setup(self) -> None:
        super().setup()
        cfg, dt = self.config, self.dtype
        E, L, P = cfg.hidden_size, cfg.num_layers, cfg.hidden_size_per_layer_input
        if P:   # per-layer embeddings, all layers' in one table [V', L * P]
            self.embed_tokens_per_layer = Embed(cfg.vocab_size_per_layer_input, L * P, dt)
            self.per_layer_model_projection = Einsum("TE,EQ->TQ", (E, L * P), ("embed", None),
                                                     dtype=dt)
            self.per_layer_projection_norm = _norm(cfg, P, dt)

    def embed(self, inputs: ModelInputs) -> tuple[jax.Array, dict[str, Any]]:
        cfg, dt = self.config, self.dtype
        E = cfg.hidden_size
        # transformers scales in the weights' dtype (sqrt(E) rounded to it in bfloat16);
        # image tokens take their (unscaled) soft tokens.
        x = merge_image_embeds(self.embed_tokens(inputs.token_ids) * jnp.asarray(E ** 0.5, dt),
                               inputs)
        P = cfg.hidden_size_per_layer_input
        if not P:
            return x, {}
        L = cfg.num_layers
        ids = inputs.token_ids if inputs.image_rows is None else \
            jnp.where(inputs.image_rows >= 0, cfg.pad_token_id, inputs.token_ids)   # as HF
        tokens = self.embed_tokens_per_layer(ids) * jnp.asarray(P ** 0.5, dt)
        proj = self.per_layer_model_projection(x) * jnp.asarray(E ** -0.5, dt)   # [T, L*P]
        proj = self.per_layer_projection_norm(proj.reshape(-1, L, P))
        combined = (proj + tokens.reshape(-1, L, P)) * jnp.asarray(2 ** -0.5, dt)
        return x, {PER_LAYER_INPUTS: jnp.swapaxes(combined, 0, 1)}           # [L, T, P]

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)
