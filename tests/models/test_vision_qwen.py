"""Qwen3.5/3.6's vision tower (models/vision/qwen3_5_vision.py) and its mrope positions
(models/vision/mrope.py) vs transformers on a tiny random vision-language checkpoint:
image embeddings within 1e-4 (float32) of get_image_features for images of two sizes,
alone and several in one padded call, for the dense and the MoE model classes; the text
model's 3-axis positions equal to get_rope_index for prompts with images."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from PIL import Image

from models.vision.mrope import mrope_positions
from models.vision.processing import ImageTokens, expand_image_tokens, preprocess
from models.vision.qwen3_5_vision import QwenVisionConfig, encode, encoder_inputs, load_params
from tests.checkpoints import make_tiny_vision_checkpoint, model_class

# Depth 2 (the layer scan), a 6x6 position table (images both smaller and larger than it).
_VISION = dict(depth=2, num_position_embeddings=36)
SIZES = [(64, 96), (150, 70)]      # (height, width): grids 4x6 and 10x4 patches of 16


def image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def processor():
    from transformers import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": 32 * 32, "longest_edge": 64 * 32 * 32})


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def tower(request, tmp_path_factory):
    kind = request.param
    path = make_tiny_vision_checkpoint(kind, tmp_path_factory.mktemp(kind), vision=_VISION)
    with open(f"{path}/config.json") as f:
        cfg = QwenVisionConfig.from_hf(json.load(f)["vision_config"])
    reference = model_class(kind).from_pretrained(path, dtype=torch.float32).eval()
    return cfg, load_params(path, cfg), reference


def reference_embeddings(model, pixels: np.ndarray, grids: list) -> list[np.ndarray]:
    with torch.no_grad():
        out = model.model.get_image_features(torch.from_numpy(pixels), torch.tensor(grids))
    return [t.numpy() for t in out.pooler_output]


@pytest.mark.parametrize("which", [[0], [1], [0, 1, 0]])
def test_image_embeddings_match_transformers(tower, processor, which):
    """One image of each size alone, and three in one call padded past their patches
    (attention stays inside each image; padding changes nothing)."""
    cfg, params, reference = tower
    images = [preprocess(processor, "qwen3_5", [image(*SIZES[i], seed=i)])[0] for i in which]
    pixels = np.concatenate([im.pixels for im in images])
    grids = [im.grid for im in images]
    want = reference_embeddings(reference, pixels, grids)
    pad = 3 * cfg.merge_unit
    inputs = encoder_inputs(cfg, grids, num_patches=len(pixels) + pad)
    got = np.asarray(jax.jit(encode, static_argnums=1)(
        params, cfg, np.concatenate([pixels, np.ones((pad, cfg.patch_dim), np.float32)]), inputs))
    start = 0
    for im, w in zip(images, want):
        assert w.shape == (im.num_tokens, cfg.out_hidden_size)
        np.testing.assert_allclose(got[start:start + im.num_tokens], w, atol=1e-4, rtol=0)
        start += im.num_tokens
    assert np.abs(want[0]).max() > 0.1     # not a vanishing signal


def test_encoder_inputs_refuse_bad_padding_and_grids():
    cfg = QwenVisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)
    with pytest.raises(ValueError, match="num_patches"):
        encoder_inputs(cfg, [(1, 4, 6)], num_patches=23)
    with pytest.raises(ValueError, match="multiple of the merge size"):
        encoder_inputs(cfg, [(1, 3, 6)])


def _prompt(parts: list, image_token: int) -> list[int]:
    """Text ids and image markers (None) as Qwen's template writes them:
    <|vision_start|> <|image_pad|> <|vision_end|> (here ids 250, image_token, 251)."""
    out: list[int] = []
    for p in parts:
        out.extend([250, image_token, 251] if p is None else p)
    return out


@pytest.mark.parametrize("layout", ["one", "two_between_text", "three_back_to_back", "text_only"])
def test_mrope_positions_match_get_rope_index(tower, processor, layout):
    cfg, _, reference = tower
    image_token = 249
    parts = {"one": [[1, 5, 6], None, [7, 8, 9, 10]],
             "two_between_text": [[1, 5], None, [11, 12, 13], None, [14]],
             "three_back_to_back": [None, None, [20], None],
             "text_only": [[1, 2, 3, 4, 5]]}[layout]
    n = sum(p is None for p in parts)
    images = [preprocess(processor, "qwen3_5", [image(*SIZES[i % 2], seed=i)])[0] for i in range(n)]
    ids = expand_image_tokens(_prompt(parts, image_token), images, ImageTokens(image=image_token))
    grids = [im.grid for im in images]
    got, delta = mrope_positions(ids, grids, image_token, cfg.spatial_merge_size)
    input_ids = torch.tensor([ids])
    want, want_delta = reference.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == image_token).int(),
        image_grid_thw=torch.tensor(grids) if grids else None)
    np.testing.assert_array_equal(got, want[:, 0].numpy())
    assert delta == int(want_delta)
    if n:
        assert not np.array_equal(got[1], got[2])     # the image's rows and columns differ


def test_mrope_refuses_mismatched_images():
    grid = (1, 4, 6)     # 6 tokens at merge 2
    with pytest.raises(ValueError, match="fewer"):
        mrope_positions([1, 9, 9, 9, 2], [grid], 9, 2)
    with pytest.raises(ValueError, match="1 image grids given but the prompt holds 0"):
        mrope_positions([1, 2], [grid], 9, 2)
    with pytest.raises(ValueError, match="beyond"):
        mrope_positions([9] * 6 + [1, 9], [grid], 9, 2)


def test_bfloat16_tower_errs_no_more_than_transformers_in_bfloat16(tower, processor):
    """Loaded in bfloat16, the tower is as far from the float32 reference as transformers'
    own bfloat16 forward is (within 2x)."""
    import copy

    import jax.numpy as jnp
    cfg, params, reference = tower
    im = preprocess(processor, "qwen3_5", [image(*SIZES[0], seed=0)])[0]
    want = reference_embeddings(reference, im.pixels, [im.grid])[0]
    with torch.no_grad():
        ref16 = copy.deepcopy(reference).to(torch.bfloat16).model.get_image_features(
            torch.from_numpy(im.pixels).to(torch.bfloat16), torch.tensor([im.grid])).pooler_output[0]
    params16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params)
    got = jax.jit(encode, static_argnums=1)(params16, cfg, im.pixels, encoder_inputs(cfg, [im.grid]))
    assert got.dtype == jnp.bfloat16
    hf_err = np.abs(ref16.float().numpy() - want).max()
    assert np.abs(np.asarray(got, np.float32) - want).max() <= 2 * hf_err + 1e-3
