"""One face for both towers: from a checkpoint's config.json to packed, padded encoder
calls and back to per-image embeddings. The engine (issue 42 part 2) jits `encode` once
per bucket: Qwen buckets the patch count (several images packed by segment id), Gemma 4
the image count (every image is padded to the same patch count by its processor)."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.vision import gemma4_vision, qwen3_5_vision
from models.vision.common import Params, count_params, query_block
from models.vision.processing import GEMMA4, ImageTokens, ProcessedImage, vision_family


# The smallest patch bucket of a Qwen encoder call (4 image tokens).
_SMALLEST_PATCHES = 16


def _ladder(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from `smallest` below `largest`, then `largest`."""
    out, b = [], smallest
    while b < largest:
        out.append(b)
        b *= 2
    return tuple(out) + (largest,)


@dataclass(frozen=True)
class VisionTower:
    family: str
    config: qwen3_5_vision.QwenVisionConfig | gemma4_vision.GemmaVisionConfig
    tokens: ImageTokens

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionTower:
        family = vision_family(config)
        cfg = (gemma4_vision.GemmaVisionConfig.from_hf(config) if family == GEMMA4
               else qwen3_5_vision.QwenVisionConfig.from_hf(config["vision_config"]))
        return cls(family, cfg, ImageTokens.from_config(config))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> VisionTower:
        with open(Path(model_dir) / "config.json") as f:
            return cls.from_config(json.load(f))

    @property
    def _module(self) -> Any:
        return gemma4_vision if self.family == GEMMA4 else qwen3_5_vision

    def load_params(self, model_dir: str | Path, dtype: Any = jnp.float32) -> Params:
        return self._module.load_params(model_dir, self.config, dtype)

    def num_params(self, model_dir: str | Path) -> int:
        """The tower's (and projector's) parameters in the checkpoint, read from its
        headers: what load_params loads."""
        prefixes = (gemma4_vision.TOWER, gemma4_vision.EMBED) if self.family == GEMMA4 \
            else (qwen3_5_vision.PREFIX,)
        return count_params(model_dir, prefixes)

    def activation_bytes(self, bucket: int, max_tokens: int, itemsize: int) -> int:
        """Rough peak of one encoder call's temporaries at `bucket`, for the accelerator's
        reserve. `encode`'s attention over `length` patches a sequence (Qwen: one sequence
        of the bucket's patches; Gemma 4: `bucket` images of max_tokens x pooling^2
        patches) scores one tile of `block` queries x `block` keys at a time
        (common.attention), whose scores [sequences, heads, block, block] hold, per score,
        up to three float32 arrays (libtpu keeps the logits, their masked copy and the
        row maxima broadcast beside the exponentials when the dot is in bfloat16), the
        probabilities in the model dtype and the tile's mask broadcast over the heads (a
        byte); beside them the query block's float32 accumulators (the running sum of
        p v, before and after a tile) and one layer's widest rows: q, k, v, their
        tile-major copies and the MLP's hidden, at 4 bytes an element (XLA:CPU computes a
        16-bit dot on float32 copies of its operands; libtpu keeps them 16-bit, which
        this overstates); a float32 copy of the pixels where one is made (Gemma 4
        scales them to [-1, 1]; a 16-bit dtype rounds them), and Gemma 4's pooling
        one-hot [sequences, length, max_tokens]. The layers run under scan, so one
        layer's temporaries live at a time: the figure grows linearly in the patches
        (Gemma 4's one-hot: in the patches x max_tokens). The compilers differ by 4x on
        the scores (XLA:CPU, and libtpu for most programs, keep one float32 array): this
        is the worst one's figure, checked in tests/models/test_vision_activation.py."""
        cfg = self.config
        seqs, length = (bucket, max_tokens * cfg.pooling_kernel_size ** 2) \
            if self.family == GEMMA4 else (1, bucket)
        block = query_block(length)
        width = cfg.num_heads * cfg.head_dim
        scores = seqs * cfg.num_heads * block * block * (3 * 4 + itemsize + 1)
        accumulators = seqs * block * width * 2 * 4
        rows = seqs * length * (6 * width + cfg.intermediate_size) * 4
        gemma = self.family == GEMMA4
        patch_dim = 3 * cfg.patch_size ** 2 if gemma else cfg.patch_dim
        pixels = seqs * length * patch_dim * 4 if gemma or itemsize < 4 else 0
        pooling = seqs * length * max_tokens * 4 if gemma else 0
        return scores + accumulators + rows + pixels + pooling

    def bucket_size(self, images: Sequence[ProcessedImage]) -> int:
        """What a bucket counts for these images: patches (Qwen) or images (Gemma 4)."""
        return len(images) if self.family == GEMMA4 else sum(len(im.pixels) for im in images)

    def pack(self, images: Sequence[ProcessedImage], bucket: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Host arrays for one `encode` call on `images`, padded to `bucket`."""
        if bucket < self.bucket_size(images):
            raise ValueError(f"bucket {bucket} is smaller than the images' {self.bucket_size(images)}")
        if self.family == GEMMA4:
            pad = bucket - len(images)
            pixels = np.stack([im.pixels for im in images])
            positions = np.stack([im.position_ids for im in images])
            pixels = np.concatenate([pixels, np.zeros((pad, *pixels.shape[1:]), pixels.dtype)])
            positions = np.concatenate([positions, np.full((pad, *positions.shape[1:]), -1, positions.dtype)])
            return pixels, gemma4_vision.encoder_inputs(self.config, positions)
        pixels = np.concatenate([im.pixels for im in images])
        pixels = np.concatenate([pixels, np.zeros((bucket - len(pixels), pixels.shape[1]), pixels.dtype)])
        return pixels, qwen3_5_vision.encoder_inputs(self.config, [im.grid for im in images], bucket)

    def encode(self, params: Params, pixels: jax.Array, inputs: dict[str, jax.Array]) -> jax.Array:
        """Jittable with `self` static."""
        return self._module.encode(params, self.config, pixels, inputs)

    # ---- serving: buckets, warmup images and where each output row goes ----------------
    def max_tokens(self, processor: Any) -> int:
        """The most image tokens (tower output rows) the processor gives one image: Gemma 4's
        max_soft_tokens; Qwen's max_pixels (its resize keeps h x w under it, both multiples
        of patch x merge) over a merged patch's pixels."""
        if self.family == GEMMA4:
            return int(processor.max_soft_tokens)
        size = processor.size
        max_pixels = size["longest_edge"] if size.get("longest_edge") else processor.max_pixels
        return int(max_pixels) // (self.config.patch_size ** 2 * self.config.merge_unit)

    def buckets(self, max_tokens: int, budget: int) -> tuple[int, ...]:
        """What encoder calls pad to: Qwen the patch count (powers of two from 16 patches
        up to one largest image's), Gemma 4 the image count (1, 2, 4, ... up to a step's
        budget of whole images)."""
        if self.family == GEMMA4:
            return _ladder(1, max(budget // max_tokens, 1))
        largest = max_tokens * self.config.merge_unit
        return _ladder(min(_SMALLEST_PATCHES, largest), largest)

    def out_rows(self, images: Sequence[ProcessedImage], rows: Sequence[Sequence[int]],
                 bucket: int, max_tokens: int, pad: int) -> np.ndarray:
        """int32: for each row `encode` returns on these images packed into `bucket`, the
        row of `rows` it goes to (`pad` for padding rows)."""
        if self.family == GEMMA4:
            dest = np.full((bucket, max_tokens), pad, np.int32)
            for i, r in enumerate(rows):
                dest[i, :len(r)] = r
            return dest.reshape(-1)
        dest = np.full(bucket // self.config.merge_unit, pad, np.int32)
        flat = [x for r in rows for x in r]
        dest[:len(flat)] = flat
        return dest

    def warmup_images(self, bucket: int, max_tokens: int) -> list[ProcessedImage]:
        """Zero images that fill `bucket`, with the shapes serving's have."""
        cfg = self.config
        if self.family == GEMMA4:
            n = max_tokens * cfg.pooling_kernel_size ** 2
            return [ProcessedImage(np.zeros((n, 3 * cfg.patch_size ** 2), np.float32), 1,
                                   position_ids=np.zeros((n, 2), np.int32))] * bucket
        return [ProcessedImage(np.zeros((bucket, cfg.patch_dim), np.float32),
                               bucket // cfg.merge_unit, grid=(1, 2, bucket // 2))]

    def unpack(self, out: Any, images: Sequence[ProcessedImage]) -> list[Any]:
        """Each image's embeddings [num_tokens, text_hidden] from `encode`'s output."""
        if self.family == GEMMA4:
            return [out[i, :im.num_tokens] for i, im in enumerate(images)]
        starts = np.cumsum([0] + [im.num_tokens for im in images])
        return [out[s:s + im.num_tokens] for s, im in zip(starts, images)]
