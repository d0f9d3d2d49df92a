"""Model families: each family's facts behind one interface (host only, no jax).

A family is the architectures one implementation serves (Llama, Qwen3, Qwen3-MoE,
Qwen3.5/3.6, Gemma 4). Code outside models/ never asks which family a model is; it asks
the model's family (`ModelConfig.family`) for the answer it needs -- which dimensions the
model axis must divide, how wide one token's temporaries are -- or asks the model what
each layer keeps (cache specs, models/cache_spec.py). What differs between families is
said once, here, as a field of its ModelFamily; the arithmetic is shared.

Also here: how an HF config.json names the family (architectures, model_type), which
families' attention has q_norm / k_norm, and which tensor names their checkpoints
write differently from the param tree's (models/weight_names.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from models.gemma4_config import gemma4_fields

if TYPE_CHECKING:
    from models.config import ModelConfig


@dataclass(frozen=True)
class ModelFamily:
    """One family's facts; every field says how it differs from a plain decoder."""
    name: str
    architectures: tuple[str, ...]
    # HF model_type -> architecture, for a config.json without `architectures`.
    model_types: tuple[tuple[str, str], ...] = ()
    qk_norm: bool = False                  # RMSNorm over head_dim on q and k, before RoPE
    # Gated DeltaNet layers beside gated attention (Qwen3.5/3.6: a "hybrid" model): the
    # config reads layer_types, partial RoPE, (1 + w) norms, an output gate and MTP layers.
    linear_attention: bool = False
    # config.json (whole, its text model's part) -> ModelConfig fields but weight_quant,
    # for a family whose config.json is its own (Gemma 4); None: models/hf_config.py's.
    read_fields: Callable[[str, dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None
    # Gemma 4: MoE layers run their experts beside the dense MLP, not instead of it, and
    # the RMSNorm weights stay float32 whatever the model's dtype.
    experts_beside_dense_mlp: bool = False
    norm_weights_f32: bool = False
    # Checkpoint tensor names that are not the param path's (models/weight_names.py):
    # param leaf -> the HF tensor it is cut from, and params named as their HF tensor.
    fused_expert_leaves: tuple[tuple[str, str], ...] = ()
    kept_leaves: tuple[tuple[str, str], ...] = ()

    # ---- what the sharding rules ask (sharding/rules.py) -------------------------
    def model_axis_dims(self, mc: ModelConfig, expert_parallel: bool = False
                        ) -> list[tuple[str, int]]:
        """(config name, size) of every dimension split over the model axis, which M
        must divide: query heads; the dense MLP width where any layer has a dense MLP;
        the expert MLP width (expert_parallel: the expert count) and the shared expert's;
        the DeltaNet key heads. KV heads and the vocabulary need not divide (they are
        replicated instead: sharding.kv_head_layout, mesh_rules)."""
        need = [("num_attention_heads", mc.num_heads)]
        if any(self.has_dense_mlp(mc, i) for i in range(mc.num_layers)):
            need.append(("intermediate_size", mc.intermediate_size))
        if mc.num_experts:
            need.append(("num_experts", mc.num_experts) if expert_parallel else
                        ("moe_intermediate_size", mc.moe_intermediate_size))
            if mc.shared_expert_intermediate_size:
                need.append(("shared_expert_intermediate_size",
                             mc.shared_expert_intermediate_size))
        if mc.linear_attention_layers:
            need.append(("linear_num_key_heads", mc.linear_num_key_heads))
        return need

    def has_dense_mlp(self, mc: ModelConfig, i: int) -> bool:
        """Layer i runs a dense MLP (alone, or beside its experts)."""
        return self.experts_beside_dense_mlp or not mc.num_experts or not mc.is_moe_layer(i)

    # ---- what the memory budget asks (planning/kv_budget.py) ---------------------
    def activation_width(self, mc: ModelConfig, m: int) -> int:
        """Elements per token of one layer's widest temporaries on one device of a model
        axis of M: the residual (3 copies), the token mixer's projections -- attention's
        q (and its output gate), k and v, or a DeltaNet layer's q|k|v, z, a and b -- and
        the MLP's gate/up: experts see top-k copies of each token, plus the shared expert
        and (Gemma 4) the dense MLP beside them. Split by M where sharded."""
        attn = max(((mc.num_heads * (2 if mc.attn_output_gate else 1)
                     + 2 * mc.layer_num_kv_heads(i)) * mc.layer_head_dim(i)
                    for i in mc.kv_layers()), default=0) // m
        if mc.linear_attention_layers:
            linear = mc.linear_conv_dim + mc.linear_num_value_heads * (mc.linear_value_head_dim + 2)
            attn = max(attn, linear // m)
        dense = max(mc.mlp_width(i) for i in range(mc.num_layers))
        if mc.num_experts:
            width = (mc.moe_intermediate_size * mc.num_experts_per_tok
                     + mc.shared_expert_intermediate_size
                     + (dense if self.experts_beside_dense_mlp else 0))
        else:
            width = dense
        return 3 * mc.hidden_size + attn + 2 * width // m


LLAMA = ModelFamily("llama", ("LlamaForCausalLM",), (("llama", "LlamaForCausalLM"),))
QWEN3 = ModelFamily("qwen3", ("Qwen3ForCausalLM",), (("qwen3", "Qwen3ForCausalLM"),),
                    qk_norm=True)
QWEN3_MOE = ModelFamily("qwen3_moe", ("Qwen3MoeForCausalLM",),
                        (("qwen3_moe", "Qwen3MoeForCausalLM"),), qk_norm=True)
# Qwen3.5 / 3.6, dense and MoE; the vision-language checkpoints serve their text model.
QWEN3_5 = ModelFamily(
    "qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
                "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    (("qwen3_5", "Qwen3_5ForConditionalGeneration"), ("qwen3_5_text", "Qwen3_5ForCausalLM"),
     ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
     ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")),
    qk_norm=True, linear_attention=True)
# Gemma 4: sliding-window layers beside global ones, per-layer embeddings, KV sharing;
# each layer's experts stored as one [X, 2F, E] gate_up_proj and one [X, E, F] down_proj.
GEMMA4 = ModelFamily(
    "gemma4", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    (("gemma4", "Gemma4ForConditionalGeneration"), ("gemma4_text", "Gemma4ForCausalLM")),
    qk_norm=True, read_fields=gemma4_fields, experts_beside_dense_mlp=True, norm_weights_f32=True,
    fused_expert_leaves=(("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj")),
    kept_leaves=(("router", "scale"),))

FAMILIES: tuple[ModelFamily, ...] = (LLAMA, QWEN3, QWEN3_MOE, QWEN3_5, GEMMA4)
_BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}
# Architectures served (models/registry.py maps each family to its module).
SUPPORTED_ARCHITECTURES = tuple(sorted(_BY_ARCHITECTURE))
MODEL_TYPE_TO_ARCH = {t: a for f in FAMILIES for t, a in f.model_types}


def family_of(architecture: str) -> ModelFamily:
    """The family that serves `architecture` (ValueError naming the supported ones)."""
    try:
        return _BY_ARCHITECTURE[architecture]
    except KeyError:
        raise ValueError(f"Architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}") from None
