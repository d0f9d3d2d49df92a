"""Gemma 4's image tokens see their whole image; every attention backend takes that mask
(the Pallas kernels included, as each token's horizon), so no backend refuses its images
at start-up: the vision side is loaded and an image request passes the front."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxserve.build.vision import vision_parts
from jaxserve.config.media import MediaConfig
from jaxserve.multimodal.front import ImageFront
from tests.checkpoints import make_tiny_vision_serving_checkpoint


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> str:
    return make_tiny_vision_serving_checkpoint(
        "gemma4_vl", tmp_path_factory.mktemp("g4") / "g", use_bidirectional_attention="vision")


@pytest.mark.parametrize("backend", ["pallas", "pallas_interpret", "xla", "reference"])
def test_gemma4_images_are_served_on_every_backend(gemma4, backend):
    front = ImageFront.for_model(gemma4, MediaConfig())
    parts = vision_parts(front, jnp.float32, 128, 64, whole_images=True)
    assert parts is not None and front.refusal is None
    front.check_count(1, "messages")
