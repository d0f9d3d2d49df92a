"""The encoder programs (runner/image_encoder.py) compiled for TPU v6e by libtpu's
deviceless compiler, both towers, every bucket: the encoder cache is written in place
(donated: no copy of the cache anywhere in the program)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxserve.build.vision import vision_parts
from jaxserve.config.media import MediaConfig
from jaxserve.multimodal.front import ImageFront
from jaxserve.runner.image_encoder import ImageEncoder
from tests.checkpoints import make_tiny_vision_serving_checkpoint

pytest.importorskip("libtpu")
from sharding.tpu_targets import abstract_tpu_mesh   # noqa: E402  (after the skip)
from tests.sharding.test_forward_tpu_hlo import whole_cache_copies  # noqa: E402

ROWS = 1 << 20     # 128 MiB of bfloat16 at 64 columns: too large to stage in VMEM


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma4_vl"])
def test_encoder_programs_compile_for_v6e_and_write_the_cache_in_place(kind, tmp_path):
    path = make_tiny_vision_serving_checkpoint(kind, tmp_path / "ckpt")
    parts = vision_parts(ImageFront.for_model(path, MediaConfig()), jnp.bfloat16, 256, 64)
    parts = dataclasses.replace(parts, num_rows=ROWS)
    mesh = abstract_tpu_mesh("tpu-v6e", "1x1")
    encoder = ImageEncoder(parts, hidden_size=64, dtype=jnp.bfloat16, mesh=mesh, abstract=True)
    programs = encoder.programs()
    assert [p.tokens for p in programs] == list(parts.buckets) and len(programs) > 1
    for program in programs:
        with jax.set_mesh(mesh):
            compiled = program.fn.lower(*program.args()).compile()
        assert not whole_cache_copies(compiled.as_text(), {(ROWS, 64)}), program.tokens
        assert compiled.memory_analysis() is not None
