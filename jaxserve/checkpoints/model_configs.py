"""Short model names and built-in copies of their published config.json files.

The one source for both the planner (`python -m jaxserve.plan --model qwen3.6-27b`) and
`--load-format dummy` (random weights at the real shape, no download). Keys are as in
the published files; the Qwen3.5/3.6 vision-language wrappers keep their text model
under `text_config` and their `vision_config` is left out (jaxserve serves the text).
Files written by transformers < 5 carry `rope_theta` + `rope_scaling`, kept as published.
"""
from __future__ import annotations

from jaxserve.checkpoints.gemma4_configs import ALIASES as GEMMA4_ALIASES
from jaxserve.checkpoints.gemma4_configs import CONFIGS as GEMMA4_CONFIGS

FULL, LINEAR = "full_attention", "linear_attention"

# alias -> Hugging Face repo id (aliases are matched case-insensitively).
ALIASES: dict[str, str] = {
    "qwen3.6-27b": "Qwen/Qwen3.6-27B",
    "qwen3.6-35b-a3b": "Qwen/Qwen3.6-35B-A3B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    **GEMMA4_ALIASES,
}


def _hybrid_layers(num_layers: int, interval: int = 4) -> list[str]:
    """Qwen3.5/3.6: (interval - 1) Gated DeltaNet layers, then one full-attention layer."""
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]


# Qwen3.5/3.6 share the tokenizer: <|endoftext|> = 248044; multimodal ids of the wrapper.
_QWEN35_WRAPPER = {
    "image_token_id": 248056, "video_token_id": 248057,
    "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "tie_word_embeddings": False,
}
# Text fields every Qwen3.5/3.6 checkpoint shares.
_QWEN35_TEXT = {
    "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
    "bos_token_id": 248044, "eos_token_id": 248044, "pad_token_id": None,
    "dtype": "bfloat16", "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
    "initializer_range": 0.02, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144, "mlp_only_layers": [], "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
    # mrope sections reduce to plain RoPE for text (three equal position streams).
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                        "partial_rotary_factor": 0.25, "rope_theta": 10000000,
                        "rope_type": "default"},
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 248320,
}

BUILTIN_CONFIGS: dict[str, dict] = {
    "qwen3.6-27b": {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "language_model_only": False, **_QWEN35_WRAPPER,
        "text_config": {
            **_QWEN35_TEXT, "model_type": "qwen3_5_text", "hidden_size": 5120,
            "intermediate_size": 17408, "num_hidden_layers": 64, "layer_types": _hybrid_layers(64),
            "num_attention_heads": 24, "num_key_value_heads": 4, "linear_num_value_heads": 48,
        },
    },
    "qwen3.6-35b-a3b": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        **_QWEN35_WRAPPER,
        "text_config": {
            # No dense MLP: every layer is 256 experts (top-8) plus a shared expert.
            **_QWEN35_TEXT, "model_type": "qwen3_5_moe_text", "hidden_size": 2048,
            "num_hidden_layers": 40, "layer_types": _hybrid_layers(40),
            "num_attention_heads": 16, "num_key_value_heads": 2, "linear_num_value_heads": 32,
            "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        },
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
        "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
        "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-5,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 128256,
    },
    **GEMMA4_CONFIGS,
}
assert set(BUILTIN_CONFIGS) == set(ALIASES)
