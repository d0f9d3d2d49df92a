"""HF checkpoint tensor names <-> param paths, and each tensor's change of layout.

Our param paths mirror the HF names, so the mapping is mechanical:
  ("layers_3", "self_attn", "q_proj", "kernel") <- "model.layers.3.self_attn.q_proj.weight"
  ("lm_head", "kernel") <- "lm_head.weight";  ("mlp", "experts", "gate_proj") <- stack of
  "mlp.experts.{i}.gate_proj.weight".
What a family's checkpoints name otherwise is its ModelFamily's (models/family.py: fused
expert tensors, params named as their tensor). HF linear weights are [out, in]; our
kernels are [in..., out...], so a kernel is `w.T.reshape(param_shape)` (q_proj [N*H, E]
-> [E, N, H], o_proj [E, N*H] -> [N, H, E]).
"""
from __future__ import annotations

import numpy as np

from models.config import ModelConfig
from models.layer_stack import layer_period
from models.param_tree import Path_
from models.quantization import SCALE_SUFFIX

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
# Present in some checkpoints, never needed.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# Vision-language checkpoints: the text model lives here; the vision (and Gemma 4's audio)
# towers are not served, and the multi-token-prediction layer is loaded on its own for
# speculative decoding (load_params' prefix, models/mtp.py).
VL_TEXT_PREFIX = "model.language_model."
SKIPPED_PREFIXES = ("model.visual.", "mtp.", "model.vision_tower.", "model.embed_vision.",
                    "model.audio_tower.", "model.embed_audio.")
_LEAF_TO_HF = {"kernel": "weight", "scale": "weight", "offset_scale": "weight", "embedding": "weight"}


def hf_names(path: Path_, cfg: ModelConfig, prefix: str = "model.") -> np.ndarray:
    """HF tensor names feeding one param, shaped as the param's stacked leading axes:
    () for one tensor, [X] for stacked experts, [G] for a scanned model's stacked
    layers (models/layer_stack.py: block g's sublayer j is layer g * period + j),
    [G, X] for both. `prefix` is where the checkpoint keeps the decoder ("model." or
    the VL text model's)."""
    if path == ("lm_head", "kernel"):
        return np.array("lm_head.weight", dtype=object)
    if path[-1].endswith(SCALE_SUFFIX) and path[-1][:-len(SCALE_SUFFIX)] in ("kernel", *EXPERT_PROJS):
        path = path[:-1] + (path[-1][:-len(SCALE_SUFFIX)],)   # a quantized kernel's scale
    scanned = path[0] == "layers"            # ("layers", "layers_j", ...)
    if scanned:
        period, j = layer_period(cfg), int(path[1][len("layers_"):])
        layers, path = [g * period + j for g in range(cfg.num_layers // period)], path[2:]
    elif path[0].startswith("layers_"):
        layers, path = [int(path[0][len("layers_"):])], path[1:]
    else:
        layers = [None]
    experts = len(path) >= 3 and path[-3:-1] == ("mlp", "experts") and path[-1] in EXPERT_PROJS
    kept, fused = cfg.family.kept_leaves, dict(cfg.family.fused_expert_leaves)

    def name(layer: int | None, expert: int | None) -> str:
        head = [] if layer is None else [f"layers.{layer}"]
        if experts:
            tail = [f"{expert}.{path[-1]}.weight"]
        elif path[-2:] in kept:
            tail = [path[-1]]
        elif path[-2:-1] == ("experts",):   # Gemma 4: all experts in one tensor, gate|up fused
            tail = [fused.get(path[-1], path[-1])]
        else:
            tail = [_LEAF_TO_HF.get(path[-1], path[-1])]
        return prefix + ".".join(head + list(path[:-1]) + tail)

    names = np.array([[name(layer, e) for e in (range(cfg.num_experts) if experts else [None])]
                      for layer in layers], dtype=object)
    if not experts:
        names = names[:, 0, ...]
    return names if scanned else names[0, ...]


def group_by_key_head(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """DeltaNet channels on the last axis, [all q | all k | all v] -> [Hk, 2 Dk + r Dv]
    (each key head's q, k and its value heads together: models/gated_deltanet.py)."""
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    lead = w.shape[:-1]
    q, k, v = np.split(w, [hk * dk, 2 * hk * dk], axis=-1)
    return np.concatenate([q.reshape(*lead, hk, dk), k.reshape(*lead, hk, dk),
                           v.reshape(*lead, hk, -1)], axis=-1)


def to_param_layout(w: np.ndarray, path: Path_, shape: tuple[int, ...], name: str,
                     cfg: ModelConfig) -> np.ndarray:
    kind = path[-1]
    if path[-2:] == ("conv1d", "kernel"):   # HF depthwise [C, 1, kernel] -> [kernel, Hk, G]
        if w.ndim != 3 or w.shape[1] != 1:
            raise ValueError(f"tensor {name!r} has shape {w.shape}; expected [channels, 1, kernel]")
        w = group_by_key_head(w[:, 0, :].T, cfg)
    elif path[-2:] == ("in_proj_qkv", "kernel"):
        if w.ndim != 2:
            raise ValueError(f"tensor {name!r} has shape {w.shape}; expected a 2-D [out, in] weight")
        w = group_by_key_head(w.T, cfg)
    elif path[-2:-1] == ("experts",) and w.ndim == 3:   # Gemma 4's [X, out, in] experts
        if kind in dict(cfg.family.fused_expert_leaves):   # gate_up_proj: gate rows, then up rows
            half = w.shape[1] // 2
            w = w[:, :half] if kind == "gate_proj" else w[:, half:]
        w = np.swapaxes(w, 1, 2)
    elif kind == "kernel" or kind in EXPERT_PROJS:   # HF [out, in] -> ours [in..., out...]
        if w.ndim != 2:
            raise ValueError(f"tensor {name!r} has shape {w.shape}; expected a 2-D [out, in] weight")
        w = w.T
    if int(np.prod(w.shape)) != int(np.prod(shape)):
        raise ValueError(f"tensor {name!r} has shape {w.shape}; param {'/'.join(path)} needs {shape}")
    return w.reshape(shape)
