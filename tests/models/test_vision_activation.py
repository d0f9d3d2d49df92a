"""VisionTower.activation_bytes (the accelerator's reserve for the largest encoder call,
build/vision.py) against what the compilers allocate for that call: the temporaries of
`encode` compiled for the largest bucket of a large image (the attention's scores of one
tile of queries x keys and the rows), by XLA:CPU (float32, bfloat16) and by libtpu for
TPU v6e (deviceless, bfloat16). The figure is the worst compiler's: no compiler may need
more than it (+20 %), and XLA:CPU not less than a fifth of it (libtpu may keep a whole
tile's scores in VMEM). And the attention's working set stays bounded as the patches
grow: Qwen's published maximum, 65536 patches, fits in less than one block of queries'
scores over all keys (what the attention blocked by queries alone needed)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from models.vision.tower import VisionTower
from tests.checkpoints import make_tiny_vision_checkpoint

# (bucket, tokens an image): Qwen one image of 16384 tokens (65536 patches, the published
# processor's 16-megapixel maximum: 64 x 64 tiles); Gemma 4 two images of 280 tokens
# (2520 patches each: 3 x 3 tiles).
LARGEST = {"qwen3_5": (65536, 16384), "gemma4_vl": (2, 280)}
_TEMP: dict[tuple, int] = {}   # compiled temporaries, shared by the tests


@pytest.fixture(scope="module", params=sorted(LARGEST))
def tower(request, tmp_path_factory) -> tuple[VisionTower, str, str]:
    path = make_tiny_vision_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return VisionTower.from_pretrained(path), path, request.param


def compiled_temp_bytes(tower: VisionTower, path: str, kind: str, dtype, target: str,
                        bucket: int, max_tokens: int) -> int:
    key = (kind, jnp.dtype(dtype).name, target, bucket)
    if key not in _TEMP:
        _TEMP[key] = _compile_temp_bytes(tower, path, dtype, target, bucket, max_tokens)
    return _TEMP[key]


def _compile_temp_bytes(tower: VisionTower, path: str, dtype, target: str, bucket: int,
                        max_tokens: int) -> int:
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
    temp = compiled_temp_bytes(tower, path, kind, dtype, target, bucket, max_tokens)
    assert temp <= 1.2 * formula, (temp, formula)
    if target == "cpu":
        assert formula <= 5 * temp, (temp, formula)


@pytest.mark.parametrize("tower", ["qwen3_5"], indirect=True)   # one sequence grows with the bucket
def test_the_working_set_stays_bounded_as_the_patches_grow(tower):
    """Qwen, XLA:CPU float32, 8192 -> 65536 patches: the temporaries grow at most
    linearly (the rows; the tile is fixed), and at 65536 stay under a quarter of one
    float32 block of 1024 queries' scores over all keys. Blocked by queries alone they
    grew about 4x per doubling above 8192 (208 MB at 8192, 1.6 GB at 32768 patches, and
    the whole [patches, patches] mask beside them)."""
    tower, path, kind = tower
    small, large = (compiled_temp_bytes(tower, path, kind, jnp.float32, "cpu", b, b // 4)
                    for b in (8192, 65536))
    assert large <= 8 * small, (small, large)
    assert large < 0.25 * tower.config.num_heads * 1024 * 65536 * 4, large
