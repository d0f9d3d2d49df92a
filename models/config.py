"""ModelConfig: the architecture facts jaxserve needs, read from a HF config.json.

Host-only (no jax import) so host code may read model facts cheaply.
Accepts both RoPE formats: transformers 5 `rope_parameters` and the older
`rope_theta` + `rope_scaling`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("jaxserve")

# HF model_type -> architecture, for config.json files without `architectures`.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
    "gemma4_text": "Gemma4ForCausalLM",
}
# Architectures served (models/registry.py maps each to its module).
SUPPORTED_ARCHITECTURES = tuple(sorted((
    "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
    "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")))
# Qwen3.5 / Qwen3.6: hybrid Gated DeltaNet + gated attention (dense and MoE).
HYBRID_ARCHS = frozenset(a for a in SUPPORTED_ARCHITECTURES if a.startswith("Qwen3_5"))
# What weights and activations may be computed in (the "auto" rule is
# models.registry.resolve_dtype's); jaxserve.config offers these names.
SERVING_DTYPES = ("float32", "bfloat16", "float16")
# Weight quantization methods (--quantization) -> the dtype the linear layers' kernels
# are stored in (models/quantization.py does the arithmetic).
WEIGHT_QUANT_DTYPES = {"fp8": "float8_e4m3fn", "int8": "int8"}
# Gemma 4: sliding-window layers beside global (full) ones, per-layer embeddings, KV sharing.
GEMMA4_ARCHS = frozenset(("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"))
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
SLIDING_ATTENTION = "sliding_attention"
# Layer types that keep a paged KV cache (a kind each: models/layer_stack.py).
KV_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
# Families whose attention has q_norm / k_norm (RMSNorm over head_dim, before RoPE).
_QK_NORM_ARCHS = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}) | HYBRID_ARCHS | GEMMA4_ARCHS
_QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "proportional")
# MLP activations: SwiGLU (silu) and Gemma's GeGLU (tanh-approximated gelu).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class WeightQuant:
    """How the linear layers' kernels are stored: in `method`'s dtype with float32 scales,
    one per output channel and per `block_in` rows of the contraction (None: one block of
    all rows, i.e. per output channel). An FP8 block checkpoint (quantization_config
    weight_block_size [block_out, block_in]) keeps its blocks; block_out only says how to
    read its scales (each output channel gets its block's)."""
    method: str                   # a key of WEIGHT_QUANT_DTYPES
    block_in: int | None = None
    block_out: int | None = None  # a checkpoint's; None when quantized at load
    # True: activations quantized per token to the same dtype in the step and the matmul
    # run in it (w8a8); False: activations stay in the model dtype (w8a16).
    dynamic_activations: bool = False

    def __post_init__(self) -> None:
        if self.method not in WEIGHT_QUANT_DTYPES:
            raise ValueError(f"quantization {self.method!r}: expected one of "
                             f"{tuple(WEIGHT_QUANT_DTYPES)}")
        for name in ("block_in", "block_out"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")

    @property
    def dtype_name(self) -> str:
        return WEIGHT_QUANT_DTYPES[self.method]


def resolve_weight_quant(method: str | None, checkpoint: WeightQuant | None,
                         activations: str | None = None) -> WeightQuant | None:
    """How the engine stores the weights: a quantized checkpoint's own quantization
    (`method` may only repeat it, as vLLM requires), else `method` per output channel
    (None: unquantized). activations "dynamic": w8a8 (per-channel weights only)."""
    if checkpoint is not None:
        if method not in (None, checkpoint.method):
            raise ValueError(f"quantization={method!r}: the checkpoint is already "
                             f"{checkpoint.method}-quantized (its config.json "
                             f"quantization_config); omit the flag or pass {checkpoint.method}")
        if activations is not None:
            raise ValueError(f"activation_quantization={activations!r}: the checkpoint's "
                             f"{checkpoint.method} block scales are applied per weight block; "
                             f"quantized activations need per-output-channel weights (serve "
                             f"an unquantized checkpoint with --quantization)")
        return checkpoint
    if method is None:
        if activations is not None:
            raise ValueError(f"activation_quantization={activations!r} needs --quantization "
                             f"(fp8 or int8): the activations take the weights' dtype")
        return None
    if activations not in (None, "dynamic"):
        raise ValueError(f"activation_quantization={activations!r}: expected 'dynamic' or none")
    return WeightQuant(method, dynamic_activations=activations == "dynamic")


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
        return self.architecture in GEMMA4_ARCHS

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
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        if archs:
            architecture = archs[0]
        elif model_type in _MODEL_TYPE_TO_ARCH:
            architecture = _MODEL_TYPE_TO_ARCH[model_type]
        elif d.get("auto_map"):
            raise ValueError(_unsupported(str(model_type), d))
        else:
            raise ValueError(f"config has no 'architectures' and unknown model_type {model_type!r}")
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unsupported(architecture, d))
        t = d.get("text_config") or d  # multimodal wrappers keep the text model here
        if architecture in GEMMA4_ARCHS:
            from models.gemma4_config import gemma4_fields
            return cls(**gemma4_fields(architecture, d, t),
                       weight_quant=_parse_quantization(d.get("quantization_config")
                                                        or t.get("quantization_config")))

        def need(key: str) -> Any:
            if t.get(key) is None:
                raise ValueError(f"config for {architecture} is missing {key!r}")
            return t[key]

        if t.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"hidden_act {t['hidden_act']!r} is not supported (only silu)")
        if t.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if t.get("use_sliding_window") and t.get("sliding_window"):
            raise ValueError(f"sliding-window attention (sliding_window={t['sliding_window']}) is not supported")

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        max_pos = int(t.get("max_position_embeddings") or 4096)
        hybrid = architecture in HYBRID_ARCHS
        theta, scaling, rotary_factor = _parse_rope(t, max_pos, allow_partial=hybrid)
        num_layers = int(need("num_hidden_layers"))
        layer_types: tuple[str, ...] = ()
        if hybrid:
            layer_types = tuple(t.get("layer_types") or (
                FULL_ATTENTION if (i + 1) % int(t.get("full_attention_interval") or 4) == 0
                else LINEAR_ATTENTION for i in range(num_layers)))
        eos = t.get("eos_token_id", d.get("eos_token_id"))
        if isinstance(eos, list):
            eos = tuple(int(e) for e in eos)
        mt = t.get("model_type", model_type)
        return cls(
            architecture=architecture,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            # Qwen3.5-MoE has no dense MLP width (every layer is sparse).
            intermediate_size=int(t.get("intermediate_size") or 0) if hybrid and t.get(
                "num_experts") else int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(t.get("num_key_value_heads") or heads),
            head_dim=int(t.get("head_dim") or hidden // heads),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(t.get("tie_word_embeddings", d.get("tie_word_embeddings", False))),
            max_position_embeddings=max_pos,
            attention_bias=bool(t.get("attention_bias", False)),
            qk_norm=architecture in _QK_NORM_ARCHS or mt in _QK_NORM_MODEL_TYPES,
            dtype=t.get("dtype") or t.get("torch_dtype") or d.get("dtype") or d.get("torch_dtype"),
            eos_token_id=eos,
            bos_token_id=t.get("bos_token_id", d.get("bos_token_id")),
            num_experts=int(t.get("num_experts") or t.get("num_local_experts") or 0),
            num_experts_per_tok=int(t.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(t.get("moe_intermediate_size") or 0),
            # Qwen3.5-MoE always renormalises the top-k router weights.
            norm_topk_prob=bool(t.get("norm_topk_prob", hybrid)),
            decoder_sparse_step=int(t.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in (t.get("mlp_only_layers") or ())),
            shared_expert_intermediate_size=int(t.get("shared_expert_intermediate_size") or 0),
            layer_types=layer_types,
            linear_num_key_heads=int(t.get("linear_num_key_heads") or 0),
            linear_num_value_heads=int(t.get("linear_num_value_heads") or 0),
            linear_key_head_dim=int(t.get("linear_key_head_dim") or 0),
            linear_value_head_dim=int(t.get("linear_value_head_dim") or 0),
            linear_conv_kernel_dim=int(t.get("linear_conv_kernel_dim") or 0),
            partial_rotary_factor=rotary_factor,
            attn_output_gate=hybrid,
            norm_plus_one=hybrid,
            num_mtp_layers=int(t.get("mtp_num_hidden_layers") or 0) if hybrid else 0,
            mtp_dedicated_embeddings=bool(t.get("mtp_use_dedicated_embeddings", False)),
            weight_quant=_parse_quantization(d.get("quantization_config")
                                             or t.get("quantization_config")),
        )


def _parse_quantization(q: dict[str, Any] | None) -> WeightQuant | None:
    """A checkpoint's quantization_config: FP8 with dynamic activation scales and block
    weight scales (DeepSeek / Qwen "-FP8" checkpoints) is served as it is; anything else
    is refused by name rather than read as if it were unquantized."""
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"checkpoint quantization_config quant_method={method!r} is not "
                         f"supported: jaxserve reads fp8 block-quantized checkpoints, or "
                         f"quantizes an unquantized one at load (--quantization fp8|int8)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"fp8 checkpoint with activation_scheme="
                         f"{q['activation_scheme']!r}: only dynamic activation scales are "
                         f"supported")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 checkpoint with fmt={q['fmt']!r}: only e4m3 weights are supported")
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError(f"fp8 checkpoint with weight_block_size={block!r}: expected "
                         f"[block_out, block_in] (per-tensor fp8 checkpoints are not supported)")
    return WeightQuant("fp8", block_in=int(block[1]), block_out=int(block[0]))


def _parse_rope(t: dict[str, Any], max_pos: int, allow_partial: bool = False
                ) -> tuple[float, dict[str, Any] | None, float]:
    """Returns (theta, normalised scaling dict or None, partial rotary factor) from either
    config format. Qwen3.5's multimodal RoPE sections (mrope_section) reduce to plain RoPE
    for text, where the three position streams are equal."""
    params = t.get("rope_parameters")
    if params:
        if all(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"per-layer-type rope_parameters are not supported: {sorted(params)}")
        theta = params.get("rope_theta", t.get("rope_theta"))
    else:
        params = t.get("rope_scaling") or {}
        theta = t.get("rope_theta")
    theta = float(theta if theta is not None else 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = float(params.get("partial_rotary_factor", t.get("partial_rotary_factor") or 1.0))
    if partial != 1.0 and not allow_partial:
        raise ValueError("partial_rotary_factor != 1 is not supported for this architecture")

    if rope_type == "default":
        return theta, None, partial
    if rope_type == "linear":
        return theta, {"rope_type": "linear", "factor": float(params["factor"])}, partial
    if rope_type == "llama3":
        try:
            return theta, {
                "rope_type": "llama3",
                "factor": float(params["factor"]),
                "low_freq_factor": float(params["low_freq_factor"]),
                "high_freq_factor": float(params["high_freq_factor"]),
                "original_max_position_embeddings": int(
                    params.get("original_max_position_embeddings")
                    or t.get("original_max_position_embeddings") or max_pos),
            }, partial
        except KeyError as e:
            raise ValueError(f"llama3 rope scaling is missing {e.args[0]!r}") from None
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _unsupported(architecture: str, d: dict[str, Any]) -> str:
    """Why `architecture` is refused; a config.json with auto_map asks for its own code."""
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if d.get("auto_map"):
        return (f"architecture {architecture!r} needs the checkpoint's own Python code "
                f"(config.json auto_map), and jaxserve runs only its own implementations of "
                f"{supported}; --trust-remote-code does not change that")
    return f"Architecture {architecture!r} is not supported; supported: {supported}"
