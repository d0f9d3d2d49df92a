"""Built-in copies of Gemma 4's published config.json files (the text model; the vision
and audio towers' configs are left out: jaxserve serves the text). Instruction-tuned
repos, as the vLLM guides serve them."""
from __future__ import annotations

FULL, SLIDING = "full_attention", "sliding_attention"

ALIASES = {
    "gemma-4-31b": "google/gemma-4-31B-it",
    "gemma-4-26b-a4b": "google/gemma-4-26B-A4B-it",
    "gemma-4-e4b": "google/gemma-4-E4B-it",
    "gemma-4-e2b": "google/gemma-4-E2B-it",
}


def _pattern(num_layers: int, period: int) -> list[str]:
    """(period - 1) sliding-window layers, then a global one; the last layer global."""
    return [FULL if (i + 1) % period == 0 or i == num_layers - 1 else SLIDING
            for i in range(num_layers)]


# Fields every size shares.
_TEXT = {
    "model_type": "gemma4_text", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "dtype": "bfloat16",
    "final_logit_softcapping": 30.0, "global_head_dim": 512, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "rope_parameters": {
        FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        SLIDING: {"rope_theta": 10000.0, "rope_type": "default"},
    },
    "tie_word_embeddings": True, "use_cache": True, "vocab_size": 262144,
    "vocab_size_per_layer_input": 262144, "enable_moe_block": False, "num_experts": None,
    "top_k_experts": None, "moe_intermediate_size": None, "use_double_wide_mlp": False,
    "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "attention_k_eq_v": False,
    "num_global_key_value_heads": None, "use_bidirectional_attention": "vision",
}


def _wrapper(text: dict) -> dict:
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
            "boi_token_id": 255999, "eoi_token_id": 258882, "image_token_id": 258880,
            "audio_token_id": 258881, "eos_token_id": [1, 106], "tie_word_embeddings": True,
            "dtype": "bfloat16", "text_config": {**_TEXT, **text}}


CONFIGS: dict[str, dict] = {
    "gemma-4-31b": _wrapper({
        "hidden_size": 5376, "num_hidden_layers": 60, "intermediate_size": 21504,
        "num_attention_heads": 32, "num_key_value_heads": 16, "num_global_key_value_heads": 4,
        "attention_k_eq_v": True, "sliding_window": 1024, "max_position_embeddings": 262144,
        "layer_types": _pattern(60, 6),
    }),
    "gemma-4-26b-a4b": _wrapper({
        # A 128-expert MoE block (top 8) beside a dense MLP in every layer.
        "hidden_size": 2816, "num_hidden_layers": 30, "intermediate_size": 2112,
        "num_attention_heads": 16, "num_key_value_heads": 8, "num_global_key_value_heads": 2,
        "attention_k_eq_v": True, "sliding_window": 1024, "max_position_embeddings": 262144,
        "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
        "moe_intermediate_size": 704, "layer_types": _pattern(30, 6),
    }),
    "gemma-4-e4b": _wrapper({
        # Per-layer embeddings; the last 18 layers read earlier layers' KV.
        "hidden_size": 2560, "num_hidden_layers": 42, "intermediate_size": 10240,
        "num_attention_heads": 8, "num_key_value_heads": 2, "sliding_window": 512,
        "max_position_embeddings": 131072, "hidden_size_per_layer_input": 256,
        "num_kv_shared_layers": 18, "layer_types": _pattern(42, 6),
    }),
    "gemma-4-e2b": _wrapper({
        # 4:1 pattern; the last 20 layers share KV and have double-wide MLPs.
        "hidden_size": 1536, "num_hidden_layers": 35, "intermediate_size": 6144,
        "num_attention_heads": 8, "num_key_value_heads": 1, "sliding_window": 512,
        "max_position_embeddings": 131072, "hidden_size_per_layer_input": 256,
        "num_kv_shared_layers": 20, "use_double_wide_mlp": True, "layer_types": _pattern(35, 5),
    }),
}
