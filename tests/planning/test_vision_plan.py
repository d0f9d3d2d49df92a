"""`python -m jaxserve.plan` on a checkpoint that serves images (issue 42): the vision
tower's weights, the encoder cache and the largest encoder call's activations, each
following what sizes it (the serving dtype, the image processor's largest image, the
step's token budget), and none under --language-model-only."""
from __future__ import annotations

import jax
import pytest

from jaxserve.planning.plan import make_plan
from jaxserve.planning.plan_format import format_plan
from models.config import ModelConfig
from models.vision.tower import VisionTower
from tests.checkpoints import make_tiny_vision_serving_checkpoint

SMALL, LARGE = 32 * 32 * 16, 32 * 32 * 64      # max_pixels: 16 and 64 image tokens


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return make_tiny_vision_serving_checkpoint("qwen3_5", tmp_path_factory.mktemp("pv") / "q")


def plan(path: str, **engine):
    engine.setdefault("max_num_batched_tokens", 32)
    engine.setdefault("mm_processor_kwargs", {"max_pixels": SMALL})
    return make_plan(ModelConfig.from_pretrained(path), model=path, mesh="1x1",
                     max_model_len=256, max_num_seqs=4, **engine)


def test_tower_weights_are_what_the_engine_loads(path):
    v = plan(path, dtype="float32").vision
    params = VisionTower.from_pretrained(path).load_params(path)
    n = sum(x.size for x in jax.tree_util.tree_leaves(params))
    assert v.num_params == n and v.weight_bytes == 4 * n
    assert plan(path, dtype="bfloat16").vision.weight_bytes == 2 * n


def test_a_larger_image_budget_gives_more_bytes(path):
    small, large = plan(path).vision, plan(path, mm_processor_kwargs={"max_pixels": LARGE}).vision
    assert (small.max_tokens, large.max_tokens) == (16, 64)
    assert large.buckets[-1] == 4 * small.buckets[-1]
    assert large.activation_bytes > 4 * small.activation_bytes   # attention: patches squared
    # 64 tokens an image exceed the 32-token step: a step encodes one image, the cache
    # holds two steps' worth.
    assert (small.cache_rows, large.cache_rows) == (64, 128)
    assert large.cache_bytes == 2 * small.cache_bytes
    assert plan(path, max_num_batched_tokens=256).vision.cache_rows == 512


def test_printed_and_absent_for_text_only(path):
    text = format_plan(plan(path))
    assert "vision tower" in text and "encoder cache 64 rows" in text
    assert plan(path, language_model_only=True).vision is None


def test_the_tower_is_held_before_the_caches_are_sized(path):
    """As in the engine, which loads the tower before it reads the device's free memory:
    the caches get the tower's bytes less than under --language-model-only."""
    images = plan(path, hbm_bytes=2**30)
    text = plan(path, hbm_bytes=2**30, language_model_only=True)
    assert images.memory.weight_bytes - text.memory.weight_bytes == images.vision.weight_bytes
    assert images.cache.total_bytes < text.cache.total_bytes
