"""Gemma 4's vision encoder (transformers' Gemma4VisionModel) and its projector into the
text model (`embed_vision`, Gemma4MultimodalEmbedder): what turns an image's patches
into the embeddings of its <|image|> soft tokens.

- the processor resizes each image so its patch grid (16-pixel patches) has sides that
  are multiples of the pooling kernel (3) and at most max_soft_tokens * 9 patches, and
  pads every image's patch list to that many (position (-1, -1) marks padding);
- patch embedding: pixels scaled to [-1, 1], one linear map, plus a learned embedding of
  the patch's column and one of its row;
- `num_hidden_layers` Gemma-style blocks (four plain-w RMSNorms, q/k norms, weightless v
  norm, attention scale 1, GeGLU MLP) with bidirectional attention over the image's real
  patches and 2-D rotary positions: the first half of each head rotates by the column,
  the second half by the row; linear layers may clip their inputs and outputs;
- pooling: the mean of each 3x3 block of patches, in raster order of the blocks, times
  sqrt(hidden); optionally standardised (a stored bias and scale);
- embed_vision: a weightless RMSNorm, then a linear map to the text hidden size.

Host side (`encoder_inputs`, numpy) turns the processor's image_position_ids into the
pooling indices; `encode` is one jittable function of (params, pixels, those arrays).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.vision.common import (Params, attention, axial_inv_freq, linear, need, read_tensors,
                                  rms_norm, rotate_half, stack, to_device)

TOWER, EMBED = "model.vision_tower.", "model.embed_vision."
_LINEARS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
            "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
            "down": "mlp.down_proj"}
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm")
_CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


@dataclass(frozen=True)
class GemmaVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    text_hidden_size: int
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10240
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    standardize: bool = False
    use_clipped_linears: bool = False

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> GemmaVisionConfig:
        """From the whole config.json (the projector's output is the text hidden size)."""
        v, text = config["vision_config"], config["text_config"]
        act = v.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_activation {act!r} is not supported "
                             f"(only gelu_pytorch_tanh)")
        rope = v.get("rope_parameters") or {}
        heads = v.get("num_attention_heads", 12)
        return cls(hidden_size=v.get("hidden_size", 768), intermediate_size=v.get("intermediate_size", 3072),
                   num_layers=v.get("num_hidden_layers", 16), num_heads=heads,
                   num_kv_heads=v.get("num_key_value_heads", heads), head_dim=v.get("head_dim", 64),
                   text_hidden_size=text["hidden_size"], patch_size=v.get("patch_size", 16),
                   pooling_kernel_size=v.get("pooling_kernel_size", 3),
                   position_embedding_size=v.get("position_embedding_size", 10240),
                   rms_norm_eps=v.get("rms_norm_eps", 1e-6), rope_theta=float(rope.get("rope_theta", 100.0)),
                   standardize=bool(v.get("standardize", False)),
                   use_clipped_linears=bool(v.get("use_clipped_linears", False)))


# ---- host side ------------------------------------------------------------------------

def encoder_inputs(cfg: GemmaVisionConfig, position_ids: np.ndarray) -> dict[str, np.ndarray]:
    """From the processor's image_position_ids [B, P, 2] ((column, row) of each patch,
    (-1, -1) for padding): positions [B, P, 2], valid [B, P] (real patches), and
    pool_index [B, P]: the soft token each patch is averaged into (raster order of the
    kernel x kernel blocks; padding points past the last, P / kernel^2, and is dropped)."""
    pos = np.asarray(position_ids, np.int32)
    k = cfg.pooling_kernel_size
    num_patches = pos.shape[1]
    if num_patches % (k * k):
        raise ValueError(f"{num_patches} patches per image is not a multiple of {k * k}")
    valid = (pos != -1).any(-1)
    clamped = np.maximum(pos, 0)
    blocks_per_row = (clamped[..., 0].max(-1, keepdims=True) + 1) // k
    pool = clamped[..., 0] // k + blocks_per_row * (clamped[..., 1] // k)
    pool = np.where(valid, pool, num_patches // (k * k)).astype(np.int32)
    return {"positions": pos, "valid": valid, "pool_index": pool}


def num_soft_tokens(position_ids: np.ndarray, pooling_kernel_size: int) -> list[int]:
    """Soft tokens of each image: its real patches / kernel^2 (the first that many of
    `encode`'s rows are the image's, in order)."""
    valid = (np.asarray(position_ids) != -1).any(-1)
    return [int(n) // pooling_kernel_size ** 2 for n in valid.sum(-1)]


# ---- the tower ------------------------------------------------------------------------

def _clipped(x: jax.Array, kernel: jax.Array, bounds: jax.Array, spec: str) -> jax.Array:
    """A Gemma4ClippableLinear: clamp the input, project, clamp the output (bounds are
    +-inf where the checkpoint clips nothing)."""
    y = jnp.einsum(spec, jnp.clip(x, bounds[0], bounds[1]).astype(kernel.dtype), kernel)
    return jnp.clip(y, bounds[2], bounds[3])


def _rope_2d(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """First half of each head rotated by the column angles, second half by the row's."""
    half = x.shape[-1] // 2
    parts = [x[..., :half], x[..., half:]]
    out = [p.astype(jnp.float32) * c + rotate_half(p.astype(jnp.float32)) * s
           for p, c, s in zip(parts, cos, sin)]
    return jnp.concatenate(out, axis=-1).astype(x.dtype)


def _layer(cfg: GemmaVisionConfig, x: jax.Array, p: Params, cos: tuple, sin: tuple,
           keys: jax.Array) -> jax.Array:
    eps, clip = cfg.rms_norm_eps, p["clip"]
    h = rms_norm(x, p["input_layernorm"], eps)
    q = rms_norm(_clipped(h, p["q"], clip["q"], "btc,cnh->btnh"), p["q_norm"], eps)
    k = rms_norm(_clipped(h, p["k"], clip["k"], "btc,ckh->btkh"), p["k_norm"], eps)
    v = rms_norm(_clipped(h, p["v"], clip["v"], "btc,ckh->btkh"), None, eps)
    o = attention(_rope_2d(q, cos, sin), _rope_2d(k, cos, sin), v, jnp.zeros_like(keys), keys, 1.0)
    x = x + rms_norm(_clipped(o, p["o"], clip["o"], "btnh,nhc->btc"), p["post_attention_layernorm"], eps)
    h = rms_norm(x, p["pre_feedforward_layernorm"], eps)
    gate = jax.nn.gelu(_clipped(h, p["gate"], clip["gate"], "btc,cf->btf"), approximate=True)
    h = _clipped(gate * _clipped(h, p["up"], clip["up"], "btc,cf->btf"), p["down"], clip["down"], "btf,fc->btc")
    return x + rms_norm(h, p["post_feedforward_layernorm"], eps)


def encode(params: Params, cfg: GemmaVisionConfig, pixels: jax.Array,
           inputs: dict[str, jax.Array]) -> jax.Array:
    """pixels [B, P, 3 * patch^2] (the processor's pixel_values, in [0, 1]) -> [B, P / k^2,
    text_hidden]: each image's soft-token embeddings, its first num_soft_tokens rows."""
    dtype = params["input_proj"].dtype
    pos, valid = inputs["positions"], inputs["valid"]
    x = (2.0 * (pixels.astype(jnp.float32) - 0.5)).astype(dtype) @ params["input_proj"]
    table = params["position_table"]
    clamped = jnp.maximum(pos, 0)
    pos_emb = jnp.take(table[0], clamped[..., 0], axis=0) + jnp.take(table[1], clamped[..., 1], axis=0)
    x = x + jnp.where(valid[..., None], pos_emb, 0.0).astype(dtype)
    inv_freq = jnp.asarray(axial_inv_freq(cfg.head_dim, cfg.rope_theta))
    angles = pos.astype(jnp.float32)[..., None] * inv_freq                     # [B, P, 2, H/4]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None]            # [B, P, 1, 2, H/2]
    cos = (jnp.cos(angles[..., 0, :]), jnp.cos(angles[..., 1, :]))
    sin = (jnp.sin(angles[..., 0, :]), jnp.sin(angles[..., 1, :]))
    # Every patch (padding too) sees its image's real patches: queries all in segment 0,
    # real keys in 0, padding keys in -1 (seen by none).
    keys = jnp.where(valid, 0, -1).astype(jnp.int32)

    def body(x, p):
        return _layer(cfg, x, p, cos, sin, keys), None

    x, _ = jax.lax.scan(body, x, params["layers"])
    # Pooling and scaling in float32, as the reference (the scale can overflow float16).
    x = jnp.where(valid[..., None], x.astype(jnp.float32), 0.0)
    num_out = pixels.shape[1] // cfg.pooling_kernel_size ** 2
    onehot = jax.nn.one_hot(inputs["pool_index"], num_out, dtype=jnp.float32)    # padding: all zero
    x = jnp.einsum("bps,bpc->bsc", onehot, x) / cfg.pooling_kernel_size ** 2 * cfg.hidden_size ** 0.5
    if cfg.standardize:
        x = (x - params["std_bias"].astype(jnp.float32)) * params["std_scale"].astype(jnp.float32)
    x = rms_norm(x.astype(dtype), None, cfg.rms_norm_eps)
    return x @ params["embed_proj"]


# ---- weights --------------------------------------------------------------------------

def load_params(model_dir: str | Path, cfg: GemmaVisionConfig, dtype: Any = jnp.float32) -> Params:
    """The encoder's and projector's weights from `model.vision_tower.*` / `model.embed_vision.*`."""
    t = read_tensors(model_dir, (TOWER, EMBED))
    n, kv, hd, c, layers = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.num_layers
    lay = lambda name: stack(t, TOWER + "encoder.layers.{}." + name, layers)
    kern = lambda short: lay(_LINEARS[short] + ".linear.weight").transpose(0, 2, 1)
    inf = np.float32(np.inf)

    def bounds(short: str) -> np.ndarray:
        if not cfg.use_clipped_linears:
            return np.tile(np.array([-inf, inf, -inf, inf], np.float32), (layers, 1))
        return np.stack([lay(f"{_LINEARS[short]}.{b}").reshape(layers) for b in _CLIP_BOUNDS], axis=1)

    block = {name: lay(name + ".weight") for name in _NORMS}
    block.update(q=kern("q").reshape(layers, c, n, hd), k=kern("k").reshape(layers, c, kv, hd),
                 v=kern("v").reshape(layers, c, kv, hd), o=kern("o").reshape(layers, n, hd, c),
                 gate=kern("gate"), up=kern("up"), down=kern("down"),
                 q_norm=lay("self_attn.q_norm.weight"), k_norm=lay("self_attn.k_norm.weight"),
                 clip={short: bounds(short) for short in _LINEARS})
    params = {"input_proj": linear(need(t, TOWER + "patch_embedder.input_proj.weight")),
              "position_table": need(t, TOWER + "patch_embedder.position_embedding_table"),
              "layers": block,
              "embed_proj": linear(need(t, EMBED + "embedding_projection.weight"))}
    if cfg.standardize:
        params["std_bias"] = need(t, TOWER + "std_bias")
        params["std_scale"] = need(t, TOWER + "std_scale")
    return to_device(params, dtype)

