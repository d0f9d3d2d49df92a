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
    assert large.activation_bytes > 4 * small.activation_bytes   # one tile: patches squared
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


def test_the_encoder_cache_and_calls_come_out_of_the_cache_budget(path):
    """On a device whose memory is small enough for the largest encoder call to outweigh
    the step's activations: the caches get less than under --language-model-only by the
    tower's weights, the encoder cache, and the reserve's growth to that call's peak; the
    printed budget is the one the cache plan was sized from."""
    big = {"max_pixels": LARGE}
    images = plan(path, hbm_bytes=16 << 20, mm_processor_kwargs=big)
    text = plan(path, hbm_bytes=16 << 20, mm_processor_kwargs=big, language_model_only=True)
    v, m, t = images.vision, images.memory, text.memory
    assert m.later_bytes == v.cache_bytes > 0
    assert m.reserve_bytes == v.activation_bytes > t.reserve_bytes
    assert images.kv_budget_bytes == text.kv_budget_bytes - v.weight_bytes - v.cache_bytes \
        - (v.activation_bytes - t.reserve_bytes)
    c = images.cache
    assert images.kv_budget_bytes - c.bytes_per_page - c.bytes_per_state_slot \
        < c.total_bytes <= images.kv_budget_bytes
    assert images.to_json()["memory"]["encoder_cache_bytes"] == v.cache_bytes
    # A device so large that the step's reserve (its share of the memory) covers the call.
    roomy = plan(path, hbm_bytes=16 << 30, mm_processor_kwargs=big)
    assert roomy.memory.reserve_bytes == plan(path, hbm_bytes=16 << 30, mm_processor_kwargs=big,
                                              language_model_only=True).memory.reserve_bytes


FREE_RAM = 64 << 20   # what the engine test says the host has free


def test_the_engine_takes_the_encoder_cache_out_of_its_budget(path, monkeypatch):
    """The engine on CPU (--gpu-memory-utilization: a share of the free RAM, which holds
    the weights already and keeps no activation reserve): the KV pages and state get the
    share less the encoder cache the planner prints, which is what the runner
    allocates."""
    from jaxserve import LLM
    from jaxserve.build import kv_budget
    monkeypatch.setattr(kv_budget, "available_host_bytes", lambda: FREE_RAM)
    engine = dict(dtype="float32", max_model_len=256, max_num_seqs=4,
                  max_num_batched_tokens=32, mm_processor_kwargs={"max_pixels": SMALL},
                  gpu_memory_utilization=0.5, enable_prefix_caching=False,
                  enforce_eager=True, compilation_cache_dir=None)
    images = LLM(path, **engine).engine
    text = LLM(path, language_model_only=True, **engine).engine
    v = plan(path, dtype="float32").vision
    assert images.runner.encoder.cache.nbytes == v.cache_bytes
    assert text.runner.encoder is None
    share = FREE_RAM // 2
    for core, budget in ((text, share), (images, share - v.cache_bytes)):
        c = core.info.cache_plan
        assert budget - c.bytes_per_page - c.bytes_per_state_slot < c.total_bytes <= budget
    assert images.info.cache_plan.num_pages < text.info.cache_plan.num_pages


@pytest.mark.parametrize("share", [0.5, 0.999])
def test_on_cpu_the_rest_of_the_free_ram_holds_the_largest_encoder_call(path, monkeypatch,
                                                                        share):
    """The CPU engine's caches take a share of the free RAM, and the programs' temporaries
    live in the rest: a share too large to leave the largest encoder call's activations
    (here more than the step's) is cut to leave them, as an accelerator's reserve does;
    a share that leaves them room keeps its meaning. The engine sizes its caches through
    this cache_plan_for, with the planner's figures (test above)."""
    from jaxserve.build import kv_budget
    from jaxserve.build.layout import cache_plan_for
    from jaxserve.build.parts import replica_shape
    from jaxserve.config import EngineConfig
    monkeypatch.setattr(kv_budget, "available_host_bytes", lambda: FREE_RAM)
    big = {"max_pixels": LARGE}
    config = EngineConfig(model=path, dtype="float32", max_model_len=256, max_num_seqs=4,
                          max_num_batched_tokens=32, mm_processor_kwargs=big,
                          hbm_utilization=share, compilation_cache_dir=None)
    shape = replica_shape(config, ModelConfig.from_pretrained(path), None)
    v = plan(path, dtype="float32", mm_processor_kwargs=big).vision
    assert v.activation_bytes > shape.layout.activation_bytes
    c = cache_plan_for(shape.config, shape.layout, jax.devices("cpu")[0], vision=v)
    budget = min(int(share * FREE_RAM), FREE_RAM - v.activation_bytes) - v.cache_bytes
    assert budget - c.bytes_per_page - c.bytes_per_state_slot < c.total_bytes <= budget
    assert (budget < int(share * FREE_RAM) - v.cache_bytes) == (share > 0.9)
