"""A Hugging Face config.json -> ModelConfig's fields (host only, no jax).

The architecture comes from `architectures` (or, without it, `model_type`); its family
(models/family.py) says how to read the rest: Gemma 4 has a reader of its own
(models/gemma4_config.py), every other family the one here. Accepts both RoPE formats:
transformers 5 `rope_parameters` and the older `rope_theta` + `rope_scaling`.
"""
from __future__ import annotations

from typing import Any

from models.family import MODEL_TYPE_TO_ARCH, SUPPORTED_ARCHITECTURES, family_of
from models.layer_types import FULL_ATTENTION, LINEAR_ATTENTION
from models.quant_config import parse_quantization

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "proportional")
# Attention with q_norm / k_norm also where the model_type says so (a Qwen3 checkpoint
# whose `architectures` names another family's class).
_QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})


def hf_config_fields(d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for config.json `d`; ValueError naming what is not
    supported."""
    architecture = _architecture(d)
    family = family_of(architecture)
    t = d.get("text_config") or d  # multimodal wrappers keep the text model here
    read = family.read_fields or _fields
    fields = read(architecture, d, t)
    if family.read_fields is None:
        mt = t.get("model_type", d.get("model_type"))
        fields["qk_norm"] = family.qk_norm or mt in _QK_NORM_MODEL_TYPES
    return dict(fields, weight_quant=parse_quantization(d.get("quantization_config")
                                                        or t.get("quantization_config")))


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    if archs:
        architecture = archs[0]
    elif model_type in MODEL_TYPE_TO_ARCH:
        architecture = MODEL_TYPE_TO_ARCH[model_type]
    elif d.get("auto_map"):
        raise ValueError(unsupported(str(model_type), d))
    else:
        raise ValueError(f"config has no 'architectures' and unknown model_type {model_type!r}")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(unsupported(architecture, d))
    return architecture


def _refuse_unsupported(t: dict[str, Any]) -> None:
    if t.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act {t['hidden_act']!r} is not supported (only silu)")
    if t.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    if t.get("use_sliding_window") and t.get("sliding_window"):
        raise ValueError(f"sliding-window attention (sliding_window={t['sliding_window']}) is not supported")


def _fields(architecture: str, d: dict[str, Any], t: dict[str, Any]) -> dict[str, Any]:
    """The fields of a Llama / Qwen3 / Qwen3-MoE / Qwen3.5 config.json (all but qk_norm
    and weight_quant); d: the whole file, t: its text model's part."""
    def need(key: str) -> Any:
        if t.get(key) is None:
            raise ValueError(f"config for {architecture} is missing {key!r}")
        return t[key]

    _refuse_unsupported(t)
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    max_pos = int(t.get("max_position_embeddings") or 4096)
    hybrid = family_of(architecture).linear_attention
    theta, scaling, rotary_factor = _parse_rope(t, max_pos, allow_partial=hybrid)
    num_layers = int(need("num_hidden_layers"))
    eos = t.get("eos_token_id", d.get("eos_token_id"))
    if isinstance(eos, list):
        eos = tuple(int(e) for e in eos)
    return dict(
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
        dtype=t.get("dtype") or t.get("torch_dtype") or d.get("dtype") or d.get("torch_dtype"),
        eos_token_id=eos,
        bos_token_id=t.get("bos_token_id", d.get("bos_token_id")),
        **_moe_fields(t, hybrid),
        partial_rotary_factor=rotary_factor,
        mrope_section=_mrope_section(t) if hybrid else (),
        **_linear_attention_fields(t, num_layers, hybrid),
    )


def _moe_fields(t: dict[str, Any], hybrid: bool) -> dict[str, Any]:
    return dict(
        num_experts=int(t.get("num_experts") or t.get("num_local_experts") or 0),
        num_experts_per_tok=int(t.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(t.get("moe_intermediate_size") or 0),
        # Qwen3.5-MoE always renormalises the top-k router weights.
        norm_topk_prob=bool(t.get("norm_topk_prob", hybrid)),
        decoder_sparse_step=int(t.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in (t.get("mlp_only_layers") or ())),
        shared_expert_intermediate_size=int(t.get("shared_expert_intermediate_size") or 0),
    )


def _linear_attention_fields(t: dict[str, Any], num_layers: int, hybrid: bool) -> dict[str, Any]:
    """Qwen3.5/3.6's Gated DeltaNet layers and what comes with them (gated attention,
    (1 + w) norms, MTP layers); a model without them reads no layer types."""
    layer_types: tuple[str, ...] = ()
    if hybrid:
        layer_types = tuple(t.get("layer_types") or (
            FULL_ATTENTION if (i + 1) % int(t.get("full_attention_interval") or 4) == 0
            else LINEAR_ATTENTION for i in range(num_layers)))
    return dict(
        layer_types=layer_types,
        linear_num_key_heads=int(t.get("linear_num_key_heads") or 0),
        linear_num_value_heads=int(t.get("linear_num_value_heads") or 0),
        linear_key_head_dim=int(t.get("linear_key_head_dim") or 0),
        linear_value_head_dim=int(t.get("linear_value_head_dim") or 0),
        linear_conv_kernel_dim=int(t.get("linear_conv_kernel_dim") or 0),
        attn_output_gate=hybrid,
        norm_plus_one=hybrid,
        num_mtp_layers=int(t.get("mtp_num_hidden_layers") or 0) if hybrid else 0,
        mtp_dedicated_embeddings=bool(t.get("mtp_use_dedicated_embeddings", False)),
    )


def _mrope_section(t: dict[str, Any]) -> tuple[int, ...]:
    """Qwen3.5's frequencies per position axis (transformers' default when absent)."""
    params = t.get("rope_parameters") or t.get("rope_scaling") or {}
    return tuple(int(n) for n in params.get("mrope_section") or (11, 11, 10))


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


def unsupported(architecture: str, d: dict[str, Any]) -> str:
    """Why `architecture` is refused; a config.json with auto_map asks for its own code."""
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if d.get("auto_map"):
        return (f"architecture {architecture!r} needs the checkpoint's own Python code "
                f"(config.json auto_map), and jaxserve runs only its own implementations of "
                f"{supported}; --trust-remote-code does not change that")
    return f"Architecture {architecture!r} is not supported; supported: {supported}"
