"""Llama and Qwen3 decoders (one code path; Qwen3 = config.qk_norm on).

API the runner relies on:
    hidden, caches = model.apply({"params": p}, caches, inputs)   # [T, E]; caches: a dict of
                                                                  # stacked arrays (layer_stack)
    logits = model.apply({"params": p}, hidden_rows, method="compute_logits")  # float32 [N, V]
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import FULL_ATTENTION, ModelConfig
from models.inputs import ModelInputs, merge_image_embeds
from models.layer_stack import (KV, KV_KIND, KV_SCALE, KV_SCALES, cache_index, layer_period,
                                num_owners, per_layer)
from models.lora.ops import LORA, LORA_STEP
from models.layers import MLP, Attention, Einsum, Embed, RMSNorm, kv_heads_axis, logical_param

KV_LAYER_TYPE = {kind: layer_type for layer_type, kind in KV_KIND.items()}

Dtype = Any


class DecoderLayer(nn.Module):
    config: ModelConfig
    mlp_cls: type = MLP          # MLP or a mixture-of-experts block with the same call signature
    dtype: Dtype = jnp.float32
    attention_backend: str = "reference"

    @nn.compact
    def __call__(self, x: jax.Array, caches: dict[str, Any], inputs: ModelInputs,
                 cache_index: Any, layer_index: Any = None) -> tuple[jax.Array, dict[str, Any]]:
        """caches: every layer's, stacked (models/layer_stack.py); this layer owns slice
        `cache_index` (an int, or the scan's traced one) of its kind's array. layer_index:
        its place in the model (likewise), for per-layer inputs riding in caches."""
        cfg, dt = self.config, self.dtype
        h = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, cfg.norm_plus_one, name="input_layernorm")(x)
        a, caches = self.token_mixer(h, caches, inputs, cache_index)
        x = x + a
        h = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, cfg.norm_plus_one,
                    name="post_attention_layernorm")(x)
        x = x + self.mlp_cls(cfg, dt, name="mlp")(h)
        return x, caches

    def token_mixer(self, h: jax.Array, caches: dict[str, Any], inputs: ModelInputs,
                    cache_index: Any) -> tuple[jax.Array, dict[str, Any]]:
        kv = caches.get(KV)   # absent from init's placeholder
        first_page = 0 if kv is None else cache_index * per_layer(kv, self.config, FULL_ATTENTION)
        kv_scale = caches[KV_SCALE][cache_index] if KV_SCALE in caches else None
        a, kv = Attention(self.config, self.dtype, self.attention_backend,
                          name="self_attn")(h, kv, inputs, first_page, kv_scale)
        return a, caches if kv is None else {**caches, KV: kv}


class LayerBlock(nn.Module):
    """`period` consecutive layers (models/layer_stack.py): the body a scanned model
    repeats num_layers / period times, block `block` of them."""
    model_cls: type
    config: ModelConfig
    dtype: Dtype = jnp.float32
    attention_backend: str = "reference"

    @nn.compact
    def __call__(self, carry: tuple[jax.Array, dict[str, Any]], block: jax.Array,
                 inputs: ModelInputs) -> tuple[tuple[jax.Array, dict[str, Any]], None]:
        cfg = self.config
        x, caches = carry
        period = layer_period(cfg)
        for j in range(period):
            # Layers of j's kind per block, times the block, plus j's place in its block.
            same_kind = num_owners(cfg, cfg.layer_type(j), range(period))
            layer = self.model_cls.make_layer(cfg, self.dtype, self.attention_backend, j,
                                              name=f"layers_{j}")
            x, caches = layer(x, caches, inputs, block * same_kind + cache_index(cfg, j),
                              block * period + j)
        return (x, caches), None


class LlamaForCausalLM(nn.Module):
    config: ModelConfig
    dtype: Dtype = jnp.float32
    attention_backend: str = "reference"   # see pallas_kernels.ragged_paged_attention.backend_options
    # True: the layers run under jax.lax.scan over stacked params, so a program compiles
    # one block of layers whatever the depth (params["layers"], leading axis = block);
    # False: a Python loop (params["layers_i"]), faster on XLA:CPU, which copies each
    # scanned layer's weights out of the stack.
    scan_layers: bool = False

    @staticmethod
    def mlp_cls_for(config: ModelConfig, layer_idx: int) -> type:
        return MLP

    @classmethod
    def make_layer(cls, config: ModelConfig, dtype: Dtype, attention_backend: str, layer_idx: int,
                   **kw: Any) -> nn.Module:
        return DecoderLayer(config, cls.mlp_cls_for(config, layer_idx), dtype, attention_backend, **kw)

    def setup(self) -> None:
        cfg = self.config
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, self.dtype)
        if self.scan_layers:
            # LoRA stacks (models/lora/slots.py) are sliced per block as the params are;
            # the step's grouping is the same for every block.
            stack = nn.scan(LayerBlock, variable_axes={"params": 0, LORA: 0},
                            variable_broadcast=LORA_STEP, split_rngs={"params": True},
                            in_axes=(0, nn.broadcast), length=cfg.num_layers // layer_period(cfg),
                            metadata_params={nn.PARTITION_NAME: "layers"})
            self.layers = stack(type(self), cfg, self.dtype, self.attention_backend)
        else:
            self.layers = [type(self).make_layer(cfg, self.dtype, self.attention_backend, i)
                           for i in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.dtype, cfg.norm_plus_one,
                            weight_f32=cfg.family.norm_weights_f32)
        if cfg.kv_cache_quantized:
            # K and V scales per KV layer and head, one param per KV array (models/kv_scales.py).
            self.kv_scale_params = {
                rider: logical_param(self, name, nn.initializers.ones,
                                     (len(owners), cfg.layer_num_kv_heads(owners[0]), 2),
                                     (None, kv_heads_axis(cfg, owners[0]), None), jnp.float32)
                for kind, (name, rider) in KV_SCALES.items()
                if (owners := cfg.kv_layers(KV_LAYER_TYPE[kind]))}
        if not cfg.tie_word_embeddings:
            self.lm_head = Einsum("TE,EV->TV", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                                  dtype=self.dtype, out_dtype=jnp.float32)

    def __call__(self, caches: dict[str, Any], inputs: ModelInputs
                 ) -> tuple[jax.Array, dict[str, Any]]:
        """caches: models/layer_stack.cache_shapes' arrays (init takes any placeholder)."""
        cfg = self.config
        x, riders = self.embed(inputs)
        if cfg.kv_cache_quantized:
            riders.update(self.kv_scale_params)
        # Riders: per-layer values the layers read beside their caches (scanned too).
        caches = {**caches, **riders}
        if self.scan_layers:
            blocks = jnp.arange(cfg.num_layers // layer_period(cfg), dtype=jnp.int32)
            (x, caches), _ = self.layers((x, caches), blocks, inputs)
        else:
            for i, layer in enumerate(self.layers):
                x, caches = layer(x, caches, inputs, cache_index(cfg, i), i)
        caches = {k: v for k, v in caches.items() if k not in riders}
        x = self.norm(x)
        if self.is_initializing():   # so that init creates the lm_head parameters too
            self.compute_logits(x)
        return x, caches

    def embed(self, inputs: ModelInputs) -> tuple[jax.Array, dict[str, Any]]:
        """The token embeddings [T, E] and the riders the layers read (none here)."""
        return merge_image_embeds(self.embed_tokens(inputs.token_ids), inputs), {}

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """[N, E] final-normed hidden rows -> float32 logits [N, V]."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(hidden)
        return self.lm_head(hidden)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Same decoder; q_norm/k_norm come from config.qk_norm (set for Qwen3 configs)."""
