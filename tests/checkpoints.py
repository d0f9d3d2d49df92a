"""Tiny random transformers checkpoints for tests (written with save_pretrained)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from jaxserve.checkpoints.tiny_tokenizer import make_tiny_tokenizer

# Small but non-trivial: GQA (4 q heads / 2 kv heads), several layers, llama3 RoPE scaling.
_BASE: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,   # the tiny tokenizer's ids
)
_KINDS: dict[str, dict[str, Any]] = {
    # two layers: the layer loop and the caches' layer axis still step (four cost every
    # llama and qwen3 engine in the suite twice the compile time)
    "llama": dict(
        num_hidden_layers=2, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    ),
    "qwen3": dict(
        num_hidden_layers=2, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3_moe": dict(
        num_hidden_layers=2, tie_word_embeddings=False, rms_norm_eps=1e-6,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}
# Qwen3.5 hybrids, saved as vision-language checkpoints (text under model.language_model):
# 3 Gated DeltaNet layers then 1 gated full-attention layer (the published period, once:
# twice cost the suite ~2x in the hybrids' compiles and steps; test_scan_layers scans two
# periods); partial RoPE.
_HYBRID = dict(
    num_hidden_layers=4, tie_word_embeddings=False, rms_norm_eps=1e-6, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)
_KINDS["qwen3_5"] = dict(_HYBRID)
_KINDS["qwen3_5_moe"] = dict(_HYBRID, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48)
_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
HYBRID_KINDS = ("qwen3_5", "qwen3_5_moe")
# Gemma 4 text models: 5 sliding-window layers (window 8, smaller than the prompts; head_dim
# 16, 2 KV heads) then a global layer (head_dim 32) -- the published 5:1 pattern.
_GEMMA4 = dict(
    num_hidden_layers=6, head_dim=16, global_head_dim=32, sliding_window=8,
    hidden_size_per_layer_input=0, final_logit_softcapping=30.0, tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)
_KINDS["gemma4"] = dict(_GEMMA4)
# 26B / 31B: global layers with one KV head and V from k_proj; the 26B's MoE beside the MLP.
_KINDS["gemma4_kv"] = dict(_GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1)
_KINDS["gemma4_moe"] = dict(_GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1,
                            enable_moe_block=True, num_experts=8, top_k_experts=2,
                            moe_intermediate_size=32)
# E2B / E4B: per-layer embeddings, the last two layers (one sliding, one global) read
# the KV of layers 3 (sliding) and 2 (global), with double-wide MLPs.
_KINDS["gemma4_e"] = dict(
    _GEMMA4, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                          "sliding_attention", "sliding_attention", "full_attention"],
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, num_kv_shared_layers=2,
    use_double_wide_mlp=True)
# A vision-language checkpoint (text under model.language_model, a tiny vision tower).
_KINDS["gemma4_vl"] = dict(_GEMMA4)
_GEMMA4_VISION = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16)
GEMMA4_KINDS = ("gemma4", "gemma4_kv", "gemma4_moe", "gemma4_e", "gemma4_vl")


def _classes(kind: str):
    if kind.startswith("gemma4"):
        from transformers import (Gemma4Config, Gemma4ForCausalLM,
                                  Gemma4ForConditionalGeneration, Gemma4TextConfig)
        return ((Gemma4Config, Gemma4ForConditionalGeneration) if kind == "gemma4_vl"
                else (Gemma4TextConfig, Gemma4ForCausalLM))
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3_5Config,
                              Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)
    return {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
            "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
            "qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration),
            "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)}[kind]


def model_class(kind: str) -> type:
    """The transformers class that loads a `kind` checkpoint."""
    return _classes(kind)[1]


def make_tiny_model(kind: str, *, seed: int = 0, **config_overrides: Any) -> torch.nn.Module:
    """A float32 tiny random model; every norm weight is randomised (1 + 0.3 randn, or
    0.3 randn for Qwen3.5's (1 + w) norms), and so are the DeltaNet's A_log and dt_bias."""
    if kind not in _KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}; known: {', '.join(_KINDS)}")
    config_cls, model_cls = _classes(kind)
    text = {**_BASE, **_KINDS[kind], **config_overrides}
    hybrid = kind in HYBRID_KINDS
    if hybrid and "num_experts" in text:
        text.pop("intermediate_size")
    if hybrid:
        config = config_cls(text_config=text, vision_config=_VISION)
    elif kind == "gemma4_vl":
        config = config_cls(text_config=text, vision_config=_GEMMA4_VISION, audio_config=None)
    else:
        config = config_cls(**text)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):   # the gated norm: plain w
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:    # input/post_attention/final norms and q_norm/k_norm
                p.copy_((0.0 if hybrid else 1.0) + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):     # decay rates exp(A_log) over two decades
                p.copy_(torch.empty(p.shape).uniform_(-2.0, 2.0, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("mlp.gate.weight", "router.proj.weight")):
                # make routing decisive, not near-uniform
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("router.scale", "router.per_expert_scale")):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
        for name, b in model.named_buffers():   # Gemma 4's stored per-layer scalar
            if name.endswith("layer_scalar"):
                b.copy_(torch.empty(b.shape).uniform_(0.5, 1.5, generator=gen))
    return model


def make_tiny_checkpoint(kind: str, path: str | Path, *, dtype: torch.dtype = torch.float32, seed: int = 0,
                         max_shard_size: str | None = None, **config_overrides: Any) -> str:
    """Writes a tiny random `kind` ("llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")
    checkpoint to `path`."""
    model = make_tiny_model(kind, seed=seed, **config_overrides).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    make_tiny_tokenizer(str(path))
    return str(path)


def add_mtp_layer(path: str | Path, *, seed: int = 0) -> str:
    """Adds a random multi-token-prediction layer to a tiny Qwen3.5 checkpoint (as the
    published ones ship it, transformers writes none): the `mtp.*` tensors (fc over
    [embedding; hidden], its two norms, one decoder layer shaped as the model's first
    full-attention layer, a final norm) and mtp_num_hidden_layers=1 in config.json."""
    import json

    from safetensors.torch import load_file, save_file
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    layer = text["layer_types"].index("full_attention")
    tensors = load_file(str(path / "model.safetensors"))
    prefix = next(p for p in ("model.language_model.", "model.") if any(
        k.startswith(p + "layers.") for k in tensors))
    gen = torch.Generator().manual_seed(seed + 7)
    hidden = text["hidden_size"]

    def rand(shape, norm: bool) -> torch.Tensor:
        return (0.3 if norm else 0.05) * torch.randn(shape, generator=gen)

    src = f"{prefix}layers.{layer}."
    mtp = {"mtp.layers.0." + k[len(src):]: rand(v.shape, "norm" in k)
           for k, v in tensors.items() if k.startswith(src)}
    mtp["mtp.fc.weight"] = rand((hidden, 2 * hidden), False)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = rand((hidden,), True)
    save_file({**tensors, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    text["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return str(path)


def reference_greedy(path: str | Path, prompts: list[list[int]], num_new: int,
                     kind: str | None = None) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, run alone, never stopping at
    eos (as jaxserve's ignore_eos); `kind` picks the class, else AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM
    cls = model_class(kind) if kind else AutoModelForCausalLM
    model = cls.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new,
                                 do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


# Linear layers an FP8 checkpoint stores in float8 (as Qwen's "-FP8" checkpoints do), plus
# the MoE router, which jaxserve keeps unquantized: loading must dequantize it.
_FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "in_proj_qkv", "in_proj_z", "out_proj", "mlp.gate")


def make_fp8_block_checkpoint(src: str | Path, fp8_dir: str | Path, dequantized_dir: str | Path,
                              block: tuple[int, int]) -> tuple[str, str]:
    """From the float checkpoint `src`: an FP8 block checkpoint (float8_e4m3fn weights,
    `weight_scale_inv` per [block_out, block_in] block, quantization_config in config.json)
    and the same model with those weights dequantized to float32 (the reference's)."""
    import json
    import shutil

    import ml_dtypes
    import numpy as np
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    bo, bi = block
    fp8_max = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    src, fp8_dir, dequantized_dir = Path(src), Path(fp8_dir), Path(dequantized_dir)
    for d in (fp8_dir, dequantized_dir):
        shutil.copytree(src, d, dirs_exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    fp8, deq = {}, {}
    for name, w in tensors.items():
        if not (name.endswith(".weight") and w.ndim == 2 and ".visual." not in name
                and any(f".{p}.weight" in name for p in _FP8_LINEARS)):
            fp8[name] = deq[name] = torch.from_numpy(np.ascontiguousarray(w))
            continue
        out, inp = w.shape
        ob, ib = -(-out // bo), -(-inp // bi)
        padded = np.zeros((ob * bo, ib * bi), np.float32)
        padded[:out, :inp] = w
        blocks = np.abs(padded.reshape(ob, bo, ib, bi)).max(axis=(1, 3))
        scale = np.where(blocks > 0, blocks / fp8_max, 1.0).astype(np.float32)     # [ob, ib]
        per_elem = np.repeat(np.repeat(scale, bo, 0), bi, 1)[:out, :inp]
        q = np.clip(w / per_elem, -fp8_max, fp8_max).astype(ml_dtypes.float8_e4m3fn)
        fp8[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
        fp8[name + "_scale_inv"] = torch.from_numpy(scale)
        deq[name] = torch.from_numpy(q.astype(np.float32) * per_elem)
    save_file(fp8, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, str(dequantized_dir / "model.safetensors"), metadata={"format": "pt"})
    with open(src / "config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "weight_block_size": [bo, bi]}
    with open(fp8_dir / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    return str(fp8_dir), str(dequantized_dir)


def make_tiny_vision_model(kind: str, *, seed: int = 0, vision: dict[str, Any] | None = None,
                           **config_overrides: Any) -> torch.nn.Module:
    """A float32 tiny vision-language `kind` ("qwen3_5", "qwen3_5_moe", "gemma4_vl") whose
    vision tower is the tiny one updated by `vision` and has every tensor randomised at a
    scale that keeps activations O(1): norm weights 1 + 0.3 randn, biases 0.1 randn,
    matrices randn / sqrt(fan_in), position tables 0.5 randn, Gemma 4's standardisation
    and clipping bounds drawn around their neutral values."""
    if kind not in (*HYBRID_KINDS, "gemma4_vl"):
        raise ValueError(f"{kind!r} is not a vision-language kind")
    config_cls, model_cls = _classes(kind)
    text = {**_BASE, **_KINDS[kind], **config_overrides}
    if kind in HYBRID_KINDS:
        if "num_experts" in text:
            text.pop("intermediate_size")
        config = config_cls(text_config=text, vision_config={**_VISION, **(vision or {})})
    else:
        config = config_cls(text_config=text, vision_config={**_GEMMA4_VISION, **(vision or {})},
                            audio_config=None)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 2)
    tower = ("model.visual.", "model.vision_tower.", "model.embed_vision.")
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if not name.startswith(tower) or not p.is_floating_point() or "inv_freq" in name:
                continue
            rand = torch.randn(p.shape, generator=gen)
            if "pos_embed" in name or "position_embedding" in name:
                p.copy_(0.5 * rand)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * rand)
            elif name.endswith("bias") or name.endswith("std_bias"):
                p.copy_(0.1 * rand)
            elif name.endswith("std_scale"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
            elif name.endswith(("input_min", "output_min")):
                p.copy_(-torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
            elif name.endswith(("input_max", "output_max")):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
            elif p.dim() >= 2:
                p.copy_(rand / p[0].numel() ** 0.5)
    return model


def make_tiny_vision_checkpoint(kind: str, path: str | Path, *, seed: int = 0,
                                vision: dict[str, Any] | None = None, **config_overrides: Any) -> str:
    """make_tiny_vision_model's model saved to `path` (float32), with the tiny tokenizer."""
    make_tiny_vision_model(kind, seed=seed, vision=vision, **config_overrides).save_pretrained(
        str(path), safe_serialization=True)
    make_tiny_tokenizer(str(path))
    return str(path)


# Image markers of the vision checkpoints' tokenizers (as the published ones spell them),
# the config.json keys of their ids, and a chat template that writes them for image parts.
VISION_MARKERS = {
    "qwen3_5": (("<|vision_start|>", "vision_start_token_id"), ("<|image_pad|>", "image_token_id"),
                ("<|vision_end|>", "vision_end_token_id")),
    "gemma4_vl": (("<|image>", "boi_token_id"), ("<|image|>", "image_token_id"),
                  ("<image|>", "eoi_token_id")),
}
_IMAGE_MARK = {"qwen3_5": "<|vision_start|><|image_pad|><|vision_end|>", "gemma4_vl": "<|image|>"}
VISION_TEMPLATE = (
    "{%- for m in messages %}<{{ m.role }}>{%- if m.content is string %}{{ m.content }}"
    "{%- else %}{%- for p in m.content %}{%- if p.type == 'image' %}MARK{%- else %}"
    "{{ p.text }}{%- endif %}{%- endfor %}{%- endif %}</{{ m.role }}>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<assistant>{%- endif %}")


def make_tiny_vision_serving_checkpoint(kind: str, path: str | Path, *, seed: int = 0,
                                        vision: dict[str, Any] | None = None,
                                        **config_overrides: Any) -> str:
    """make_tiny_vision_checkpoint's model ("qwen3_5" or "gemma4_vl") with what serving
    images needs: the image markers as special tokens (ids 256-258, the vocabulary grown to
    264), their ids in config.json, a chat template writing them for image parts and a
    small image processor (preprocessor_config.json naming the torchvision class, as the
    published checkpoints do). Qwen: at most 16 tokens an image; Gemma 4: at most 70.
    vision: the tower's config updated by it (make_tiny_vision_model); config_overrides: of
    the text model (e.g. use_bidirectional_attention="vision")."""
    import json

    from transformers import AutoTokenizer, Gemma4ImageProcessorPil, Qwen2VLImageProcessorPil
    make_tiny_vision_checkpoint(kind, path, seed=seed, vision=vision, vocab_size=264,
                                **config_overrides)
    tok = AutoTokenizer.from_pretrained(str(path))
    marks = VISION_MARKERS[kind]
    tok.add_special_tokens({"additional_special_tokens": [m for m, _ in marks]})
    tok.chat_template = VISION_TEMPLATE.replace("MARK", _IMAGE_MARK[kind])
    tok.save_pretrained(str(path))
    cfg_file = Path(path) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update({key: tok.convert_tokens_to_ids(m) for m, key in marks})
    cfg_file.write_text(json.dumps(cfg, indent=2))
    if kind == "qwen3_5":
        proc, name = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                              min_pixels=4 * 32 * 32, max_pixels=16 * 32 * 32), \
            "Qwen2VLImageProcessorFast"
    else:
        proc, name = Gemma4ImageProcessorPil(max_soft_tokens=70), "Gemma4ImageProcessor"
    proc.save_pretrained(str(path))
    pfile = Path(path) / "preprocessor_config.json"
    pcfg = json.loads(pfile.read_text())
    pcfg["image_processor_type"] = name
    pfile.write_text(json.dumps(pcfg, indent=2))
    return str(path)
