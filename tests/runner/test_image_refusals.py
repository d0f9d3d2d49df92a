"""Combinations that do not serve images are refused at start-up with their reason, and
every image request then gets a 400 naming it (issue 42): Gemma 4's image tokens see
their whole image, which the Pallas attention kernels do not do yet."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxserve.build.vision import vision_parts
from jaxserve.errors import InputError
from jaxserve.config.media import MediaConfig
from jaxserve.multimodal.front import ImageFront
from tests.checkpoints import make_tiny_vision_serving_checkpoint


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> str:
    return make_tiny_vision_serving_checkpoint(
        "gemma4_vl", tmp_path_factory.mktemp("g4") / "g", use_bidirectional_attention="vision")


@pytest.mark.parametrize("backend", ["pallas", "pallas_interpret"])
def test_gemma4_images_on_the_pallas_kernels_are_refused_by_name(gemma4, backend):
    front = ImageFront.for_model(gemma4, MediaConfig())
    assert front.refusal is None
    assert vision_parts(front, jnp.float32, 128, 64, whole_images=True,
                        attention_backend=backend) is None
    with pytest.raises(InputError, match="Gemma 4.*Pallas attention kernels.*--attention-backend xla"):
        front.check_count(1, "messages")
    front.check_count(0, "messages")          # text is still served


def test_gemma4_images_on_xla_are_served(gemma4):
    front = ImageFront.for_model(gemma4, MediaConfig())
    parts = vision_parts(front, jnp.float32, 128, 64, whole_images=True, attention_backend="xla")
    assert parts is not None and front.refusal is None
    front.check_count(1, "messages")
