"""The vision side of an engine replica, when it serves images: the tower's weights, its
encoder programs' buckets and the encoder cache's size, from the checkpoint and the image
processor the front door uses (so --mm-processor-kwargs bound the buckets too)."""
from __future__ import annotations

import logging
from typing import Any

from jaxserve.multimodal.front import ImageFront
from jaxserve.runner.image_encoder import VisionParts
from models.vision.tower import VisionTower
from pallas_kernels.ragged_paged_attention import backend_options

logger = logging.getLogger("jaxserve")

# The encoder cache holds this many steps' worth of images: the ones running requests
# still read, and room for repeated images to stay cached.
CACHE_STEPS = 2


def vision_parts(front: ImageFront, dtype: Any, num_batched_tokens: int,
                 whole_images: bool = False, attention_backend: str = "xla"
                 ) -> VisionParts | None:
    """None when the replica serves no images (a text-only model, --language-model-only,
    no image processor: the front's refusal says which). A step encodes up to its token
    budget of image tokens, or one largest image if that is more. whole_images: image
    tokens see their whole image (Gemma 4), so a chunk holds every image it reaches and
    the step's tokens must hold the largest; the Pallas kernels do not take that mask
    yet, so with them the front refuses images (the text model is served)."""
    if whole_images and front.refusal is None and \
            backend_options(attention_backend)[0] == "pallas":
        front.refusal = ("Gemma 4's image tokens attend to their whole image, which the "
                         "Pallas attention kernels do not do yet: images need "
                         "--attention-backend xla")
        logger.warning("images are refused: %s", front.refusal)
    if front.refusal is not None:
        return None
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
    params = tower.load_params(front.model_dir, dtype)
    logger.info("images: the vision tower is loaded; encoder buckets %s, at most %d tokens "
                "an image, %d encoded a step, an encoder cache of %d rows", list(buckets),
                max_tokens, budget, CACHE_STEPS * budget)
    return VisionParts(tower, params, buckets, num_rows=CACHE_STEPS * budget, budget=budget,
                       max_tokens=max_tokens)
