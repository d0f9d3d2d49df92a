"""ModelConfig: the architecture facts jaxserve needs, read from a HF config.json.

Host-only (no jax import) so host code may read model facts cheaply. Reading the file
is models/hf_config.py's; what differs between families, models/family.py's (a model's
`family`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.family import SUPPORTED_ARCHITECTURES, ModelFamily, family_of
from models.hf_config import SUPPORTED_ROPE_TYPES, hf_config_fields
from models.layer_types import FULL_ATTENTION, KV_LAYER_TYPES, LINEAR_ATTENTION, SLIDING_ATTENTION
from models.quant_config import WEIGHT_QUANT_DTYPES, WeightQuant, resolve_weight_quant

__all__ = ["FULL_ATTENTION", "KV_LAYER_TYPES", "LINEAR_ATTENTION", "SERVING_DTYPES",
           "SLIDING_ATTENTION", "SUPPORTED_ACTIVATIONS", "SUPPORTED_ARCHITECTURES",
           "SUPPORTED_ROPE_TYPES", "WEIGHT_QUANT_DTYPES", "ModelConfig", "WeightQuant",
           "resolve_weight_quant"]

logger = logging.getLogger("jaxserve")

# What weights and activations may be computed in (the "auto" rule is
# models.registry.resolve_dtype's); jaxserve.config offers these names.
SERVING_DTYPES = ("float32", "bfloat16", "float16")
# MLP activations: SwiGLU (silu) and Gemma's GeGLU (tanh-approximated gelu).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain RoPE; else a normalised dict with "rope_type" and its parameters.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    qk_norm: bool = False
    dtype: str | None = None                           # checkpoint dtype name, e.g. "bfloat16"
    eos_token_id: int | tuple[int, ...] | None = None  # lists become tuples (immutable)
    bos_token_id: int | None = None
    # Mixture of experts (0 experts = dense model).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0         # Qwen3.5-MoE: a gated shared expert
    # Hybrid models (Qwen3.5/3.6). layer_types: one of FULL_ATTENTION / LINEAR_ATTENTION
    # per layer; () = every layer full attention.
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0               # RoPE on the first head_dim * this dims
    # Qwen3.5/3.6: rotary frequencies per position axis (temporal, row, column) of images'
    # 3-axis positions, interleaved (models/vision/mrope.py); () = one position axis.
    mrope_section: tuple[int, ...] = ()
    attn_output_gate: bool = False                   # q_proj also gives a sigmoid output gate
    norm_plus_one: bool = False                      # RMSNorm weight applied as (1 + w)
    # As published: the checkpoint's quantization_config. In the engine's run config
    # (engine/layout.py): how this engine stores the weights (--quantization).
    weight_quant: WeightQuant | None = None
    # Run config only: the KV cache is stored quantized, so each attention layer holds
    # per-kv-head K and V scales (param "kv_scale", models/layers.py).
    kv_cache_quantized: bool = False
    # Run config only: the MoE experts are split whole over the model axis (X/M per
    # device, --enable-expert-parallel) instead of each expert's F (models/qwen3_moe.py).
    expert_parallel: bool = False
    hidden_act: str = "silu"                         # a SUPPORTED_ACTIVATIONS name
    # Gemma 4. Sliding-window layers (layer type SLIDING_ATTENTION) see the last
    # `sliding_window` positions, RoPE theta sliding_rope_theta, head_dim / num_kv_heads;
    # the global (FULL_ATTENTION) layers of such a model have their own head dim and KV
    # heads (0: the same), RoPE from rope_theta / rope_scaling ("proportional").
    sliding_window: int | None = None
    sliding_rope_theta: float = 10000.0
    full_head_dim: int = 0
    full_num_kv_heads: int = 0
    attention_k_eq_v: bool = False                   # global layers: V from k_proj, no v_proj
    final_logit_softcapping: float | None = None     # logits = cap * tanh(logits / cap)
    # The last num_kv_shared_layers layers compute no K/V: each reads the KV of the last
    # earlier layer of its type (kv_source); with use_double_wide_mlp their MLP is 2x wide.
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0             # per-layer embeddings (0: none)
    vocab_size_per_layer_input: int = 0
    pad_token_id: int = 0                            # per-layer embeddings' id at image tokens
    # Image tokens see their whole image on the sliding layers (Gemma 4's
    # use_bidirectional_attention "vision"): chunks never cut an image, prefix hits end
    # outside images, the step carries ModelInputs.image_horizon.
    image_attention_both_ways: bool = False
    # Qwen3.5/3.6: multi-token-prediction layers the checkpoint ships (tensors mtp.*,
    # models/mtp.py; served for speculative decoding), and whether they bring their own
    # embedding (not supported).
    num_mtp_layers: int = 0
    mtp_dedicated_embeddings: bool = False
    # Run config only: rows of up to this many tokens take the linear-attention layers'
    # recurrent step token by token (speculative decoding: 1 + the drafts of a row).
    max_decode_tokens: int = 1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, {self.num_experts}]")
        if self.decoder_sparse_step <= 0:
            raise ValueError(f"decoder_sparse_step must be positive, got {self.decoder_sparse_step}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_layers} layers")
            bad = set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION}
            if bad:
                raise ValueError(f"unsupported layer types {sorted(bad)}")
        if self.is_hybrid:
            for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel_dim"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"{name} must be positive for linear-attention layers")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"linear_num_value_heads {self.linear_num_value_heads} is not a "
                                 f"multiple of linear_num_key_heads {self.linear_num_key_heads}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; expected one of "
                             f"{SUPPORTED_ACTIVATIONS}")
        if SLIDING_ATTENTION in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ValueError("sliding-attention layers need a positive sliding_window")
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise ValueError(f"num_kv_shared_layers={self.num_kv_shared_layers}: must be in "
                             f"[0, {self.num_layers})")
        for i in range(self.num_layers - self.num_kv_shared_layers, self.num_layers):
            self.kv_source(i)   # raises when no earlier layer of its type computes KV
        for i in self.kv_layers():
            if self.num_heads % self.layer_num_kv_heads(i):
                raise ValueError(f"layer {i}: num_heads {self.num_heads} is not a multiple of "
                                 f"its {self.layer_num_kv_heads(i)} KV heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives an invalid "
                             f"rotary dimension {self.rotary_dim} for head_dim {self.head_dim}")

    def __hash__(self) -> int:  # rope_scaling is a dict; hash a frozen view of it
        items = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            items.append(tuple(sorted(v.items())) if isinstance(v, dict) else v)
        return hash(tuple(items))

    # ---- derived facts -------------------------------------------------
    @property
    def family(self) -> ModelFamily:
        """What the code outside models/ asks instead of which family this is."""
        return family_of(self.architecture)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_hybrid(self) -> bool:
        """Has linear-attention (Gated DeltaNet) layers carrying recurrent state."""
        return LINEAR_ATTENTION in self.layer_types

    def layer_type(self, layer_idx: int) -> str:
        return self.layer_types[layer_idx] if self.layer_types else FULL_ATTENTION

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Global-attention layers that own a paged KV cache (all KV layers but Gemma's
        sliding-window ones)."""
        return self.kv_layers(FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """Layers with per-sequence recurrent state instead of a KV cache."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) == LINEAR_ATTENTION)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the DeltaNet's causal conv: q, k (key heads) and v (value heads)."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def state_bytes_per_seq(self, conv_itemsize: int) -> int:
        """Recurrent state of one sequence over all linear-attention layers: the conv
        state (last kernel-1 inputs, model dtype) and the float32 delta-rule state."""
        conv = (self.linear_conv_kernel_dim - 1) * self.linear_conv_dim * conv_itemsize
        rec = (self.linear_num_value_heads * self.linear_key_head_dim
               * self.linear_value_head_dim * 4)
        return len(self.linear_attention_layers) * (conv + rec)

    @property
    def is_gemma4(self) -> bool:
        """For models/ and tests; code outside models/ asks `family` instead."""
        return self.family.name == "gemma4"

    @property
    def has_sliding_layers(self) -> bool:
        return SLIDING_ATTENTION in self.layer_types

    def layer_head_dim(self, i: int) -> int:
        """Head dim of layer i's attention (Gemma 4's global layers have their own)."""
        if self.layer_type(i) == FULL_ATTENTION and self.full_head_dim:
            return self.full_head_dim
        return self.head_dim

    def layer_num_kv_heads(self, i: int) -> int:
        """KV heads of layer i's attention (as stored, in a run config)."""
        if self.layer_type(i) == FULL_ATTENTION and self.full_num_kv_heads:
            return self.full_num_kv_heads
        return self.num_kv_heads

    def is_kv_shared(self, i: int) -> bool:
        return i >= self.num_layers - self.num_kv_shared_layers

    def kv_source(self, i: int) -> int:
        """The layer whose KV cache layer i reads: itself, or for a KV-sharing layer the
        last layer of the same type before the shared ones (as transformers' Gemma 4)."""
        if not self.is_kv_shared(i):
            return i
        first_shared = self.num_layers - self.num_kv_shared_layers
        kind = self.layer_type(i)
        for j in range(first_shared - 1, -1, -1):
            if self.layer_type(j) == kind:
                return j
        raise ValueError(f"layer {i} ({kind}) shares KV, but no earlier layer of its type "
                         f"computes any")

    def kv_layers(self, kind: str | None = None) -> tuple[int, ...]:
        """Layers that own a paged KV cache (of layer type `kind`; None: any)."""
        return tuple(i for i in range(self.num_layers)
                     if self.layer_type(i) in KV_LAYER_TYPES and not self.is_kv_shared(i)
                     and (kind is None or self.layer_type(i) == kind))

    def mlp_width(self, i: int) -> int:
        """Layer i's dense MLP width (Gemma 4 E2B: KV-sharing layers' are double)."""
        wide = self.use_double_wide_mlp and self.is_kv_shared(i)
        return self.intermediate_size * (2 if wide else 1)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Same rule as transformers' Qwen3-MoE decoder layer."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    # ---- construction --------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        if not path.is_dir():
            raise ValueError(f"model directory {str(model_dir)!r} does not exist")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"no config.json in model directory {str(model_dir)!r}")
        with open(cfg_file) as f:
            d = json.load(f)
        config = cls.from_hf_dict(d)
        if d.get("auto_map"):   # as vLLM: a known architecture runs jaxserve's code
            logger.warning("%s: config.json's auto_map names the checkpoint's own Python code; "
                           "jaxserve ignores it and runs its own %s", model_dir,
                           config.architecture)
        return config

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        return cls(**hf_config_fields(d))
