"""The one checkpoint directory both systems load: a real one, or random weights saved once.

With `--load-format dummy` the random weights are made by transformers (fixed torch
seed) and written as safetensors, so jaxserve and the reference read the same file;
jaxserve's own dummy loader would draw different numbers.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "generation_config.json")


def default_dtype(dtype: str, device: str) -> str:
    """--dtype auto: bfloat16 where the reference runs on a GPU, float32 on a CPU."""
    return dtype if dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")


SMALL_QWEN3_ALIAS = "small-qwen3"   # benchmarks/shared/common.py's random Qwen3 of the CPU figures


def resolve(model: str, load_format: str = "auto") -> str:
    """A local directory for `model`: "small-qwen3" is written on first use;
    jaxserve.checkpoints.model_names resolves other aliases where it exists; otherwise `model` must
    be a directory."""
    if os.path.isdir(model):
        return model
    if model == SMALL_QWEN3_ALIAS:
        from benchmarks.shared.common import make_small_qwen3
        return make_small_qwen3(os.path.join(tempfile.gettempdir(),
                                             "jaxserve-bench-qwen3-small"))
    try:
        from jaxserve.checkpoints.model_names import resolve_model
    except ModuleNotFoundError as e:
        if e.name != "jaxserve.checkpoints.model_names":
            raise
        raise ValueError(f"{model!r} is not a directory (model aliases need "
                         "jaxserve.checkpoints.model_names)") from None
    return resolve_model(model, load_format=load_format)


def read_config(path: str) -> dict[str, Any]:
    """config.json, with a vision-language checkpoint's text_config fields on top."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    return {**cfg, **(cfg.get("text_config") or {})}


def has_weights(path: str) -> bool:
    return any(f.endswith(".safetensors") for f in os.listdir(path))


def materialize_dummy(config_dir: str, dtype: str, out_root: str, seed: int = 0) -> str:
    """Random weights for config_dir's config, saved under out_root (reused if present)."""
    name = f"{os.path.basename(os.path.normpath(config_dir))}-random-{dtype}-seed{seed}"
    path = os.path.join(out_root, name)
    if os.path.exists(os.path.join(path, "config.json")) and has_weights(path):
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    tmp = path + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(config_dir, f)):
            shutil.copy(os.path.join(config_dir, f), tmp)
    os.replace(tmp, path)   # complete or absent: an interrupted write is not reused
    return path


def prepare(model: str, load_format: str, dtype: str, out_root: str,
            seed: int = 0) -> tuple[str, dict[str, Any]]:
    """(directory both systems load, a description for the results file)."""
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"--load-format must be auto or dummy, got {load_format!r}")
    src = resolve(model, load_format)
    info: dict[str, Any] = {"model": model, "resolved": src, "load_format": load_format}
    if load_format == "dummy":
        path = materialize_dummy(src, dtype, out_root, seed)
        info.update(path=path, random_weights=True,
                    weights=f"random (transformers from_config, torch seed {seed}, {dtype})")
    else:
        if not has_weights(src):
            raise ValueError(f"{src} has no safetensors weights; use --load-format dummy")
        path = src
        info.update(path=path, random_weights=False, weights="checkpoint")
    return path, info
