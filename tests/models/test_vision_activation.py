"""VisionTower.activation_bytes (the accelerator's reserve for the largest encoder call,
build/vision.py) against what the compilers allocate for that call: the temporaries of
`encode` compiled for the largest bucket of a large image (the attention's scores of one
block of queries dominate), by XLA:CPU (float32, bfloat16) and by libtpu for TPU v6e
(deviceless, bfloat16). The figure is the worst compiler's: no compiler may need more
than it (+20 %), and XLA:CPU not less than a fifth of it (libtpu may keep a whole block's
scores in VMEM: Gemma 4's 840-query blocks leave 2 MiB of temporaries in HBM)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from models.vision.tower import VisionTower
from tests.checkpoints import make_tiny_vision_checkpoint

# (bucket, tokens an image): Qwen one image of 2048 tokens (8192 patches: 8 blocks of
# queries); Gemma 4 two images of 280 tokens (2520 patches each: 3 blocks).
LARGEST = {"qwen3_5": (8192, 2048), "gemma4_vl": (2, 280)}


@pytest.fixture(scope="module", params=sorted(LARGEST))
def tower(request, tmp_path_factory) -> tuple[VisionTower, str, str]:
    path = make_tiny_vision_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return VisionTower.from_pretrained(path), path, request.param


def compiled_temp_bytes(tower: VisionTower, path: str, kind: str, dtype, target: str) -> int:
    bucket, max_tokens = LARGEST[kind]
    params = tower.load_params(path, dtype)
    pixels, inputs = tower.pack(tower.warmup_images(bucket, max_tokens), bucket)
    fn = jax.jit(tower.encode)
    if target == "cpu":
        compiled = fn.lower(params, pixels, inputs).compile()
    else:
        from sharding.tpu_targets import abstract_tpu_mesh
        mesh = abstract_tpu_mesh("tpu-v6e", "1x1")
        rep = NamedSharding(mesh, PartitionSpec())
        abstract = lambda t: jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), t)
        with jax.set_mesh(mesh):
            compiled = fn.lower(abstract(params), abstract(pixels), abstract(inputs)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


# libtpu in bfloat16 only: TPU serving's dtype, and its worst case (float32 keeps one
# float32 array of scores, as XLA:CPU does; docs/VISION.md has the table).
@pytest.mark.parametrize("target, dtype", [("cpu", jnp.float32), ("cpu", jnp.bfloat16),
                                           ("tpu", jnp.bfloat16)],
                         ids=["cpu-f32", "cpu-bf16", "tpu-bf16"])
def test_the_formula_bounds_the_compilers_temporaries(tower, target, dtype):
    if target == "tpu":
        pytest.importorskip("libtpu")
    tower, path, kind = tower
    bucket, max_tokens = LARGEST[kind]
    formula = tower.activation_bytes(bucket, max_tokens, jnp.dtype(dtype).itemsize)
    temp = compiled_temp_bytes(tower, path, kind, dtype, target)
    assert temp <= 1.2 * formula, (temp, formula)
    if target == "cpu":
        assert formula <= 5 * temp, (temp, formula)
    if kind == "qwen3_5":
        # Blocked: well under one float32 array of the whole [heads, patches, patches]
        # scores (unblocked, XLA:CPU kept one, libtpu in bfloat16 two).
        assert temp < 0.6 * tower.config.num_heads * bucket ** 2 * 4, temp
