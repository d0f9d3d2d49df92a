"""Gemma 4's config.json -> ModelConfig fields (host only, no jax).

Published files name the global layers' attention `global_head_dim` and
`num_global_key_value_heads`; files written by transformers 5 carry the same as
`per_layer_config` overrides of the full-attention layers. RoPE comes per layer type:
default on the sliding-window layers, "proportional" on the global ones. Anything this
engine would not run as transformers does is refused by name.
"""
from __future__ import annotations

from typing import Any

FULL, SLIDING = "full_attention", "sliding_attention"
_DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                        "rope_theta": 1_000_000.0}}
_LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")


def gemma4_fields(architecture: str, d: dict[str, Any], t: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments (all but weight_quant) for a Gemma 4 checkpoint;
    d: the whole config.json, t: its text model's part."""
    def need(key: str) -> Any:
        if t.get(key) is None:
            raise ValueError(f"config for {architecture} is missing {key!r}")
        return t[key]

    act = t.get("hidden_activation") or t.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {act!r} is not supported for Gemma 4 "
                         f"(only gelu_pytorch_tanh)")
    if t.get("use_bidirectional_attention") == "all":
        raise ValueError("use_bidirectional_attention='all' is not supported (causal "
                         "decoding only)")
    for key in ("attn_logit_softcapping", "query_pre_attn_scalar"):
        if t.get(key) is not None:
            raise ValueError(f"{key}={t[key]!r} is not part of Gemma 4's attention; "
                             f"jaxserve does not support it")
    num_layers, heads = int(need("num_hidden_layers")), int(need("num_attention_heads"))
    layer_types = list(t.get("layer_types") or
                       (SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)))
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    bad = set(layer_types) - {FULL, SLIDING}
    if bad:
        raise ValueError(f"unsupported Gemma 4 layer types {sorted(bad)}")
    layer_types[-1] = FULL   # transformers forces it (with a warning)
    head_dim = int(t.get("head_dim") or 256)
    kv_heads = int(t.get("num_key_value_heads") or heads)
    k_eq_v = bool(t.get("attention_k_eq_v", False))
    full_head_dim, full_kv_heads = _global_attention(t, layer_types, k_eq_v)
    sliding_theta, full_theta, full_scaling = _rope(t)
    moe = bool(t.get("enable_moe_block", False))
    # The wrapper's list (<eos>, <turn|>) and the text model's own, in that order.
    eos = [e for src in (d.get("eos_token_id"), t.get("eos_token_id") if t is not d else None)
           for e in ([src] if isinstance(src, int) else src or ())]
    eos = list(dict.fromkeys(eos)) or None
    ple = int(t.get("hidden_size_per_layer_input") or 0)
    return dict(
        architecture=architecture,
        vocab_size=int(need("vocab_size")),
        hidden_size=int(need("hidden_size")),
        intermediate_size=int(need("intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=full_theta,
        rope_scaling=full_scaling,
        tie_word_embeddings=bool(t.get("tie_word_embeddings", d.get("tie_word_embeddings", True))),
        max_position_embeddings=int(t.get("max_position_embeddings") or 131072),
        attention_bias=bool(t.get("attention_bias", False)),
        qk_norm=True,
        dtype=t.get("dtype") or t.get("torch_dtype") or d.get("dtype") or d.get("torch_dtype"),
        eos_token_id=(eos[0] if len(eos) == 1 else tuple(int(e) for e in eos)) if eos else None,
        bos_token_id=t.get("bos_token_id", d.get("bos_token_id")),
        num_experts=int(t.get("num_experts") or 0) if moe else 0,
        num_experts_per_tok=int(t.get("top_k_experts") or 0) if moe else 0,
        moe_intermediate_size=int(t.get("moe_intermediate_size") or 0) if moe else 0,
        norm_topk_prob=True,
        layer_types=tuple(layer_types),
        hidden_act=act,
        sliding_window=int(need("sliding_window")) if SLIDING in layer_types else None,
        sliding_rope_theta=sliding_theta,
        full_head_dim=full_head_dim if full_head_dim != head_dim else 0,
        full_num_kv_heads=full_kv_heads if full_kv_heads != kv_heads else 0,
        attention_k_eq_v=k_eq_v,
        final_logit_softcapping=(float(t["final_logit_softcapping"])
                                 if t.get("final_logit_softcapping") else None),
        num_kv_shared_layers=int(t.get("num_kv_shared_layers") or 0),
        use_double_wide_mlp=bool(t.get("use_double_wide_mlp", False)),
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=int(t.get("vocab_size_per_layer_input") or 0) if ple else 0,
        pad_token_id=int(t.get("pad_token_id") or 0),
        image_attention_both_ways=t.get("use_bidirectional_attention") == "vision",
    )


def _global_attention(t: dict[str, Any], layer_types: list[str], k_eq_v: bool
                      ) -> tuple[int, int]:
    """(head_dim, KV heads) of the global layers, from per_layer_config or the published
    keys (transformers' defaults: global_head_dim 512; num_global_key_value_heads only
    where attention_k_eq_v)."""
    head_dim = int(t.get("head_dim") or 256)
    kv_heads = int(t.get("num_key_value_heads") or t["num_attention_heads"])
    per_layer = t.get("per_layer_config")
    if per_layer is None:
        g_kv = t.get("num_global_key_value_heads") if k_eq_v else None
        return int(t.get("global_head_dim") or 512), int(g_kv or kv_heads)
    overrides: dict[int, dict[str, Any]] = {}
    for key, o in per_layer.items():
        i = int(key)
        unknown = set(o) - set(_LAYER_OVERRIDES)
        if unknown:
            raise ValueError(f"per_layer_config[{key}] overrides {sorted(unknown)}: only "
                             f"{_LAYER_OVERRIDES} are supported")
        if layer_types[i] != FULL:
            raise ValueError(f"per_layer_config[{key}]: overrides of sliding-window layers "
                             f"are not supported")
        overrides[i] = o
    globals_ = {(int(o.get("head_dim", head_dim)), int(o.get("num_key_value_heads", kv_heads)))
                for i, o in overrides.items()}
    missing = [i for i, k in enumerate(layer_types) if k == FULL and i not in overrides]
    if missing:
        globals_.add((head_dim, kv_heads))
    if len(globals_) != 1:
        raise ValueError(f"per_layer_config gives the global layers different shapes "
                         f"{sorted(globals_)}: jaxserve needs one (head_dim, KV heads) for all")
    return globals_.pop()


def _rope(t: dict[str, Any]) -> tuple[float, float, dict[str, Any] | None]:
    """(sliding layers' theta, global layers' theta, their rope_scaling)."""
    params = t.get("rope_parameters") or _DEFAULT_ROPE
    if not all(isinstance(v, dict) for v in params.values()):
        raise ValueError("Gemma 4 rope_parameters must be given per layer type "
                         "(sliding_attention, full_attention)")
    sliding = {**_DEFAULT_ROPE[SLIDING], **(params.get(SLIDING) or {})}
    full = {**_DEFAULT_ROPE[FULL], **(params.get(FULL) or {})}
    if sliding.get("rope_type", "default") != "default" or \
            float(sliding.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"sliding-window rope_parameters {sliding}: only default RoPE on "
                         f"the whole head is supported")
    kind = full.get("rope_type", "default")
    if kind == "default":
        if float(full.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("default RoPE with partial_rotary_factor != 1 on Gemma 4's global "
                             "layers is not supported")
        scaling = None
    elif kind == "proportional":
        scaling = {"rope_type": "proportional",
                   "partial_rotary_factor": float(full.get("partial_rotary_factor", 1.0)),
                   "factor": float(full.get("factor", 1.0))}
    else:
        raise ValueError(f"global-layer rope_type {kind!r} is not supported (default or "
                         f"proportional)")
    return float(sliding["rope_theta"]), float(full["rope_theta"]), scaling
