"""The vision side of an engine replica, when it serves images: the tower's weights, its
encoder programs' buckets and the encoder cache's size, from the checkpoint and the image
processor the front door uses (so --mm-processor-kwargs bound the buckets too)."""
from __future__ import annotations

import logging
from typing import Any

from jaxserve.multimodal.front import ImageFront
from jaxserve.runner.image_encoder import VisionParts
from models.vision.tower import VisionTower

logger = logging.getLogger("jaxserve")

# The encoder cache holds this many steps' worth of images: the ones running requests
# still read, and room for repeated images to stay cached.
CACHE_STEPS = 2


def vision_parts(front: ImageFront, dtype: Any, num_batched_tokens: int) -> VisionParts | None:
    """None when the replica serves no images (a text-only model, --language-model-only,
    no image processor: the front's refusal says which). A step encodes up to its token
    budget of image tokens, or one largest image if that is more."""
    if front.refusal is not None:
        return None
    tower = VisionTower.from_pretrained(front.model_dir)
    max_tokens = tower.max_tokens(front.processor())
    budget = max(num_batched_tokens, max_tokens)
    buckets = tower.buckets(max_tokens, budget)
    params = tower.load_params(front.model_dir, dtype)
    logger.info("images: the vision tower is loaded; encoder buckets %s, at most %d tokens "
                "an image, %d encoded a step, an encoder cache of %d rows", list(buckets),
                max_tokens, budget, CACHE_STEPS * budget)
    return VisionParts(tower, params, buckets, num_rows=CACHE_STEPS * budget, budget=budget,
                       max_tokens=max_tokens)
