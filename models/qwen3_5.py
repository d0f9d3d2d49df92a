"""Qwen3.5 / Qwen3.6 (dense and MoE): the hybrid of Gated DeltaNet and gated attention.

Layers follow config.layer_types (three linear-attention layers then one full-attention
layer, repeated): a full-attention layer is the Qwen3 attention with an output gate,
(1 + w) norms and partial RoPE (models/layers.py, switched on by the config); a
linear-attention layer is models/gated_deltanet.py and carries recurrent state in
place of a KV cache. The vision-language checkpoints (…ForConditionalGeneration) serve
their text model; models/weights.py finds it under `model.language_model`.
"""
from __future__ import annotations

from typing import Any

import jax

from models.config import LINEAR_ATTENTION, ModelConfig
from models.gated_deltanet import GatedDeltaNet
from models.inputs import ModelInputs
from models.layer_stack import CONV, RECURRENT, per_layer
from models.layers import MLP
from models.llama import DecoderLayer, LlamaForCausalLM
from models.qwen3_moe import SparseMoeBlock
from pallas_kernels.ragged_paged_attention import backend_options


class HybridDecoderLayer(DecoderLayer):
    layer_idx: int = 0   # its kind is layer_type(layer_idx); a scanned block's j serves j + k*period

    def token_mixer(self, h: jax.Array, caches: dict[str, Any], inputs: ModelInputs,
                    cache_index: Any) -> tuple[jax.Array, dict[str, Any]]:
        if self.config.layer_type(self.layer_idx) != LINEAR_ATTENTION:
            return super().token_mixer(h, caches, inputs, cache_index)
        impl, interpret = backend_options(self.attention_backend)
        state = (caches[CONV], caches[RECURRENT]) if CONV in caches else None   # None: init
        first_slot = 0 if state is None else \
            cache_index * per_layer(state[1], self.config, LINEAR_ATTENTION)
        o, state = GatedDeltaNet(self.config, self.dtype, use_pallas=impl == "pallas",
                                 interpret=interpret, name="linear_attn")(h, state, inputs, first_slot)
        return o, caches if state is None else {**caches, CONV: state[0], RECURRENT: state[1]}


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """Also serves Qwen3_5ForConditionalGeneration and the MoE variants (config.is_moe)."""

    @staticmethod
    def mlp_cls_for(config: ModelConfig, layer_idx: int) -> type:
        return SparseMoeBlock if config.is_moe_layer(layer_idx) else MLP

    @classmethod
    def make_layer(cls, config: ModelConfig, dtype: Any, attention_backend: str, layer_idx: int,
                   **kw: Any) -> HybridDecoderLayer:
        return HybridDecoderLayer(config, cls.mlp_cls_for(config, layer_idx), dtype,
                                  attention_backend, layer_idx=layer_idx, **kw)
