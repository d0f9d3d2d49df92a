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

from models.config import LINEAR_ATTENTION
from models.gated_deltanet import GatedDeltaNet
from models.inputs import ModelInputs
from models.layers import MLP
from models.llama import DecoderLayer, LlamaForCausalLM
from models.qwen3_moe import SparseMoeBlock
from pallas_kernels.ragged_paged_attention import backend_options


class HybridDecoderLayer(DecoderLayer):
    layer_idx: int = 0

    def token_mixer(self, h: jax.Array, cache: Any, inputs: ModelInputs) -> tuple[jax.Array, Any]:
        if self.config.layer_type(self.layer_idx) != LINEAR_ATTENTION:
            return super().token_mixer(h, cache, inputs)
        impl, interpret = backend_options(self.attention_backend)
        return GatedDeltaNet(self.config, self.dtype, use_pallas=impl == "pallas", interpret=interpret,
                             name="linear_attn")(h, cache, inputs)


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """Also serves Qwen3_5ForConditionalGeneration and the MoE variants (config.is_moe)."""

    def mlp_cls_for(self, layer_idx: int) -> type:
        return SparseMoeBlock if self.config.is_moe_layer(layer_idx) else MLP

    def layer_for(self, layer_idx: int) -> HybridDecoderLayer:
        return HybridDecoderLayer(self.config, self.mlp_cls_for(layer_idx), self.dtype,
                                  self.attention_backend, layer_idx=layer_idx)
