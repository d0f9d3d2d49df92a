"""Qwen3.5 / Qwen3.6's vision tower (transformers' Qwen3_5VisionModel; the MoE models
carry the same tower): what turns an image's patches into the embeddings of its
<|image_pad|> tokens.

- patch embedding: a Conv3d whose stride is its kernel (temporal_patch_size x patch x
  patch), i.e. one linear map of each flattened patch (the processor's layout, C T P P);
- a learned position table on a square grid (side sqrt(num_position_embeddings)),
  resampled bilinearly (align_corners) to each image's patch grid and added;
- `depth` pre-LayerNorm blocks: bidirectional attention inside each image (each video
  frame), with 2-D rotary positions (row, column) over the whole head; GELU-tanh MLP;
- the merger: LayerNorm, then each 2x2 block of neighbouring patches (consecutive in the
  processor's patch order) concatenated, Linear, exact GELU, Linear to the text hidden size.

The host computes each image's index arrays (`encoder_inputs`, numpy), padded to a bucket
of patches; `encode` is one jittable function of (params, pixels, those arrays).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.vision.common import (Params, attention, axial_inv_freq, layer_norm, linear,
                                  need, read_tensors, rotate_half, stack, to_device)

PREFIX = "model.visual."
_EPS = 1e-6   # every LayerNorm of the tower


@dataclass(frozen=True)
class QwenVisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, vision: dict[str, Any]) -> QwenVisionConfig:
        """From config.json's `vision_config`."""
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act {act!r} is not supported (only gelu_pytorch_tanh)")
        rope = vision.get("rope_parameters") or {}
        return cls(depth=vision["depth"], hidden_size=vision["hidden_size"],
                   num_heads=vision["num_heads"], intermediate_size=vision["intermediate_size"],
                   out_hidden_size=vision["out_hidden_size"],
                   patch_size=vision.get("patch_size", 16),
                   temporal_patch_size=vision.get("temporal_patch_size", 2),
                   spatial_merge_size=vision.get("spatial_merge_size", 2),
                   in_channels=vision.get("in_channels", 3),
                   num_position_embeddings=vision.get("num_position_embeddings", 2304),
                   rope_theta=float(rope.get("rope_theta", 10000.0)))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Pixels in one flattened patch (the processor's pixel_values width)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one text-model token."""
        return self.spatial_merge_size ** 2


# ---- host side: per-patch index arrays ---------------------------------------------

def _block_order(h: int, w: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of each patch in the processor's order: m x m merge blocks in
    raster order, raster order inside each block."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // m, m, w // m, m)
    return (rows.reshape(shape).transpose(0, 2, 1, 3).ravel(),
            cols.reshape(shape).transpose(0, 2, 1, 3).ravel())


def _bilinear_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """align_corners bilinear resampling of a `side` table to `size` points: the two
    source taps of each point and their weights (float32, as the reference computes)."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    frac = (src - floor).astype(np.float32)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    return taps, np.stack([np.float32(1) - frac, frac], axis=1)


def encoder_inputs(cfg: QwenVisionConfig, grids: list[tuple[int, int, int]],
                   num_patches: int | None = None) -> dict[str, np.ndarray]:
    """The index arrays `encode` needs for images/videos of these (t, h, w) patch grids
    (the processor's image_grid_thw), padded to `num_patches` (a multiple of the merge
    unit; default: no padding):
      pos_index/pos_weight [P, 4]: the position-table rows mixed into each patch;
      rope_pos [P, 2]: each patch's (row, column) for the rotary embedding;
      segment [P]: which image frame a patch belongs to (attention stays inside it), -1 pad.
    """
    m, side = cfg.spatial_merge_size, math.isqrt(cfg.num_position_embeddings)
    idx, wts, rope, seg = [], [], [], []
    frame = 0
    for t, h, w in grids:
        if h % m or w % m:
            raise ValueError(f"image grid {h}x{w} is not a multiple of the merge size {m}")
        rows, cols = _block_order(h, w, m)
        rt, rw = _bilinear_taps(rows, h, side)
        ct, cw = _bilinear_taps(cols, w, side)
        taps = (rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4)
        weights = (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)
        for _ in range(t):   # each frame: same positions, its own attention segment
            idx.append(taps)
            wts.append(weights)
            rope.append(np.stack([rows, cols], axis=1))
            seg.append(np.full(h * w, frame))
            frame += 1
    total = sum(len(s) for s in seg)
    n = total if num_patches is None else num_patches
    if n < total or n % cfg.merge_unit:
        raise ValueError(f"num_patches {n} must be a multiple of {cfg.merge_unit} and at least {total}")
    pad = n - total

    def cat(parts: list[np.ndarray], dtype: Any, fill: int = 0) -> np.ndarray:
        a = np.concatenate(parts).astype(dtype)
        return np.concatenate([a, np.full((pad, *a.shape[1:]), fill, dtype)])

    return {"pos_index": cat(idx, np.int32), "pos_weight": cat(wts, np.float32),
            "rope_pos": cat(rope, np.int32), "segment": cat(seg, np.int32, -1)}


# ---- the tower ------------------------------------------------------------------------

def _block(cfg: QwenVisionConfig, x: jax.Array, p: Params, cos: jax.Array, sin: jax.Array,
           seg: jax.Array) -> jax.Array:
    h = layer_norm(x, p["norm1_w"], p["norm1_b"], _EPS)
    qkv = jnp.einsum("tc,cknh->tknh", h, p["qkv_kernel"]) + p["qkv_bias"]
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]                     # [P, N, H]
    q = (q.astype(jnp.float32) * cos + rotate_half(q.astype(jnp.float32)) * sin).astype(x.dtype)
    k = (k.astype(jnp.float32) * cos + rotate_half(k.astype(jnp.float32)) * sin).astype(x.dtype)
    o = attention(q, k, v, seg, seg, cfg.head_dim ** -0.5)   # within each frame
    x = x + jnp.einsum("tnh,nhc->tc", o, p["proj_kernel"]) + p["proj_bias"]
    h = layer_norm(x, p["norm2_w"], p["norm2_b"], _EPS)
    h = jax.nn.gelu(h @ p["fc1_kernel"] + p["fc1_bias"], approximate=True)
    return x + h @ p["fc2_kernel"] + p["fc2_bias"]


def encode(params: Params, cfg: QwenVisionConfig, pixels: jax.Array,
           inputs: dict[str, jax.Array]) -> jax.Array:
    """pixels [P, patch_dim] (the processor's pixel_values, padded like `inputs`) ->
    [P / merge_unit, out_hidden_size]: the embeddings of the images' <|image_pad|> tokens,
    in order (padding rows at the end are garbage, the caller drops them)."""
    dtype = params["patch_kernel"].dtype
    x = pixels.astype(dtype) @ params["patch_kernel"] + params["patch_bias"]
    pos = jnp.take(params["pos_embed"], inputs["pos_index"], axis=0)          # [P, 4, C]
    x = x + jnp.einsum("tjc,tj->tc", pos, inputs["pos_weight"].astype(dtype))
    inv_freq = jnp.asarray(axial_inv_freq(cfg.head_dim, cfg.rope_theta))
    freqs = inputs["rope_pos"].astype(jnp.float32)[:, :, None] * inv_freq     # [P, 2, H/4]
    angles = jnp.concatenate([freqs[:, 0], freqs[:, 1], freqs[:, 0], freqs[:, 1]], axis=-1)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]     # [P, 1, H]
    seg = inputs["segment"]

    def body(x, p):
        return _block(cfg, x, p, cos, sin, seg), None

    x, _ = jax.lax.scan(body, x, params["blocks"])
    m = params["merger"]
    x = layer_norm(x, m["norm_w"], m["norm_b"], _EPS).reshape(-1, cfg.merge_unit * cfg.hidden_size)
    x = jax.nn.gelu(x @ m["fc1_kernel"] + m["fc1_bias"], approximate=False)
    return x @ m["fc2_kernel"] + m["fc2_bias"]


# ---- weights --------------------------------------------------------------------------

def load_params(model_dir: str | Path, cfg: QwenVisionConfig, dtype: Any = jnp.float32) -> Params:
    """The tower's weights from the checkpoint's `model.visual.*` tensors."""
    t = read_tensors(model_dir, (PREFIX,))
    get = lambda name: need(t, PREFIX + name)
    c, n, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    blk = lambda name: stack(t, PREFIX + "blocks.{}." + name, cfg.depth)
    blocks = {
        "norm1_w": blk("norm1.weight"), "norm1_b": blk("norm1.bias"),
        "norm2_w": blk("norm2.weight"), "norm2_b": blk("norm2.bias"),
        "qkv_kernel": blk("attn.qkv.weight").transpose(0, 2, 1).reshape(cfg.depth, c, 3, n, hd),
        "qkv_bias": blk("attn.qkv.bias").reshape(cfg.depth, 3, n, hd),
        "proj_kernel": blk("attn.proj.weight").transpose(0, 2, 1).reshape(cfg.depth, n, hd, c),
        "proj_bias": blk("attn.proj.bias"),
        "fc1_kernel": blk("mlp.linear_fc1.weight").transpose(0, 2, 1), "fc1_bias": blk("mlp.linear_fc1.bias"),
        "fc2_kernel": blk("mlp.linear_fc2.weight").transpose(0, 2, 1), "fc2_bias": blk("mlp.linear_fc2.bias"),
    }
    merger = {"norm_w": get("merger.norm.weight"), "norm_b": get("merger.norm.bias"),
              "fc1_kernel": linear(get("merger.linear_fc1.weight")), "fc1_bias": get("merger.linear_fc1.bias"),
              "fc2_kernel": linear(get("merger.linear_fc2.weight")), "fc2_bias": get("merger.linear_fc2.bias")}
    patch = get("patch_embed.proj.weight")
    if patch.shape[1:] != (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size):
        raise ValueError(f"vision patch_embed weight has shape {patch.shape}, the config says "
                         f"{(c, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)}")
    params = {"patch_kernel": linear(patch.reshape(c, -1)), "patch_bias": get("patch_embed.proj.bias"),
              "pos_embed": get("pos_embed.weight"), "blocks": blocks, "merger": merger}
    return to_device(params, dtype)

