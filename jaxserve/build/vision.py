"""The vision side of an engine replica, when it serves images: the tower's weights, its
encoder programs' buckets and the encoder cache's size, from the checkpoint and the image
processor the front door uses (so --mm-processor-kwargs bound the buckets too)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from jaxserve.multimodal.front import ImageFront
from jaxserve.runner.image_encoder import VisionParts
from models.vision.tower import VisionTower

logger = logging.getLogger("jaxserve")

# The encoder cache holds this many steps' worth of images: the ones running requests
# still read, and room for repeated images to stay cached.
CACHE_STEPS = 2


@dataclass(frozen=True)
class VisionFigures:
    """The vision side's sizes, for the engine and `python -m jaxserve.plan`."""
    max_tokens: int             # the most rows one image takes (its processor's)
    budget: int                 # the most rows a step encodes
    buckets: tuple[int, ...]    # what an encoder call pads to (models/vision/tower.py)
    cache_rows: int             # the encoder cache's embedding rows
    num_params: int             # the tower's and projector's
    weight_bytes: int           # in the serving dtype, replicated on every device
    cache_bytes: int            # the encoder cache [cache_rows, text hidden]
    activation_bytes: int       # rough peak of the largest bucket's encoder call

    def describe(self) -> str:
        gib = 2 ** 30
        return (f"images: vision tower {self.num_params / 1e6:.1f} M params, "
                f"{self.weight_bytes / gib:.3f} GiB; encoder cache {self.cache_rows} rows, "
                f"{self.cache_bytes / gib:.3f} GiB; largest encoder call (bucket "
                f"{self.buckets[-1]}) ~{self.activation_bytes / gib:.3f} GiB of activations; "
                f"at most {self.max_tokens} tokens an image, {self.budget} encoded a step "
                f"(the encoder cache and calls come out of the KV cache's budget)")


def vision_figures(front: ImageFront, dtype: Any, num_batched_tokens: int, hidden_size: int,
                   whole_images: bool = False) -> VisionFigures:
    """The sizes of the vision side of a front that takes images. whole_images: a step
    computes every image it reaches whole (Gemma 4), so its tokens must hold the largest."""
    tower = VisionTower.from_pretrained(front.model_dir)
    max_tokens = tower.max_tokens(front.processor())
    if whole_images and num_batched_tokens < max_tokens:
        raise ValueError(f"max_num_batched_tokens={num_batched_tokens} is less than an "
                         f"image's {max_tokens} tokens, which this model computes in one "
                         f"step: raise --max-num-batched-tokens, lower the processor's "
                         f"tokens an image (--mm-processor-kwargs), or serve text only "
                         f"(--language-model-only)")
    budget = max(num_batched_tokens, max_tokens)
    buckets = tower.buckets(max_tokens, budget)
    itemsize = jnp.dtype(dtype).itemsize
    num_params = tower.num_params(front.model_dir)
    rows = CACHE_STEPS * budget
    return VisionFigures(max_tokens, budget, buckets, rows, num_params,
                         num_params * itemsize, rows * hidden_size * itemsize,
                         tower.activation_bytes(buckets[-1], max_tokens, itemsize))


def vision_budget(fig: VisionFigures | None, step_activation: int) -> tuple[int, int]:
    """What the vision side takes from the caches' budget, for the engine and the plan:
    (the encoder cache, made after the caches and held beside them; the programs'
    activation peak, the larger of a step's and the largest encoder call's: the encoder
    runs as its own program before the step's forward, so their temporaries never live
    at once). The tower's weights are held before the caches are sized, as weights."""
    if fig is None:
        return 0, step_activation
    return fig.cache_bytes, max(step_activation, fig.activation_bytes)


def load_vision(front: ImageFront, dtype: Any, num_batched_tokens: int, hidden_size: int,
                whole_images: bool = False) -> tuple[VisionParts, VisionFigures] | None:
    """The runner's vision parts (the tower's weights loaded) and their figures; None
    when the replica serves no images (a text-only model, --language-model-only, no
    image processor: the front's refusal says which).
    A step encodes up to its token budget of image tokens, or one largest image if that
    is more."""
    if front.refusal is not None:
        return None
    fig = vision_figures(front, dtype, num_batched_tokens, hidden_size, whole_images)
    tower = VisionTower.from_pretrained(front.model_dir)
    params = tower.load_params(front.model_dir, dtype)
    logger.info("%s; encoder buckets %s", fig.describe(), list(fig.buckets))
    return VisionParts(tower, params, fig.buckets, num_rows=fig.cache_rows, budget=fig.budget,
                       max_tokens=fig.max_tokens), fig


def vision_parts(front: ImageFront, dtype: Any, num_batched_tokens: int, hidden_size: int,
                 whole_images: bool = False) -> VisionParts | None:
    """load_vision's parts alone."""
    side = load_vision(front, dtype, num_batched_tokens, hidden_size, whole_images)
    return side and side[0]
