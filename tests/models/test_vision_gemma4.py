"""Gemma 4's vision encoder and embed_vision projector (models/vision/gemma4_vision.py)
vs transformers on tiny random vision-language checkpoints: the soft-token embeddings
(what replaces the <|image|> tokens) within 1e-4 (float32) of get_image_features, for
images of two sizes alone and together in one call; with grouped KV heads, clipped
linears and standardisation (the 26B/31B's), and without."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from PIL import Image

from models.vision.gemma4_vision import (GemmaVisionConfig, encode, encoder_inputs, load_params,
                                         num_soft_tokens)
from models.vision.processing import preprocess
from tests.checkpoints import make_tiny_vision_checkpoint, model_class

SIZES = [(64, 96), (150, 40)]
_VARIANTS = {
    "plain": dict(num_hidden_layers=2, position_embedding_size=64),
    "gqa_clipped_standardized": dict(num_hidden_layers=2, num_key_value_heads=1, use_clipped_linears=True,
                                     standardize=True, position_embedding_size=64),
}


def image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def processor():
    from transformers import Gemma4ImageProcessorPil
    return Gemma4ImageProcessorPil(max_soft_tokens=70)    # the smallest budget: 630 patches


@pytest.fixture(scope="module", params=list(_VARIANTS))
def tower(request, tmp_path_factory):
    path = make_tiny_vision_checkpoint("gemma4_vl", tmp_path_factory.mktemp(request.param),
                                       vision=_VARIANTS[request.param])
    with open(f"{path}/config.json") as f:
        cfg = GemmaVisionConfig.from_hf(json.load(f))
    reference = model_class("gemma4_vl").from_pretrained(path, dtype=torch.float32).eval()
    return cfg, load_params(path, cfg), reference


@pytest.mark.parametrize("which", [[0], [1], [0, 1]])
def test_soft_tokens_match_transformers(tower, processor, which):
    cfg, params, reference = tower
    images = preprocess(processor, "gemma4", [image(*SIZES[i], seed=i) for i in which])
    pixels = np.stack([im.pixels for im in images])
    positions = np.stack([im.position_ids for im in images])
    with torch.no_grad():
        want = reference.model.get_image_features(torch.from_numpy(pixels),
                                                  torch.from_numpy(positions)).pooler_output
    got = np.asarray(jax.jit(encode, static_argnums=1)(params, cfg, pixels, encoder_inputs(cfg, positions)))
    counts = num_soft_tokens(positions, cfg.pooling_kernel_size)
    assert counts == [im.num_tokens for im in images]
    for g, w, n in zip(got, want, counts):
        assert w.shape == (n, cfg.text_hidden_size)
        np.testing.assert_allclose(g[:n], w.numpy(), atol=1e-4, rtol=0)
    assert len({im.position_ids[:, 0].max() for im in images}) == len(which)   # different grids


def test_encoder_inputs_pool_in_raster_order_of_blocks():
    """A 6x9-patch image (2 x 3 blocks of 3x3) padded to 63 patches: block (row r, col c)
    is soft token 3r + c; padding points past the 7 soft tokens."""
    cfg = GemmaVisionConfig(hidden_size=32, intermediate_size=32, num_layers=1, num_heads=2,
                            num_kv_heads=2, head_dim=16, text_hidden_size=64)
    cols, rows = np.meshgrid(np.arange(9), np.arange(6), indexing="xy")
    pos = np.stack([cols, rows], -1).reshape(-1, 2)
    pos = np.concatenate([pos, -np.ones((9, 2), int)])[None]
    inputs = encoder_inputs(cfg, pos)
    pool = inputs["pool_index"][0]
    assert pool[:54].reshape(6, 9).tolist() == [[3 * (r // 3) + c // 3 for c in range(9)] for r in range(6)]
    assert (pool[54:] == 7).all() and inputs["valid"][0].sum() == 54
    assert num_soft_tokens(pos, 3) == [6]


def test_bfloat16_tower_errs_no_more_than_transformers_in_bfloat16(tower, processor):
    """Loaded in bfloat16, the tower is as far from the float32 reference as transformers'
    own bfloat16 forward is (within 2x)."""
    import copy

    import jax.numpy as jnp
    cfg, params, reference = tower
    im = preprocess(processor, "gemma4", [image(*SIZES[0], seed=0)])[0]
    pixels, positions = torch.from_numpy(im.pixels[None]), torch.from_numpy(im.position_ids[None])
    with torch.no_grad():
        want = reference.model.get_image_features(pixels, positions).pooler_output[0].numpy()
        ref16 = copy.deepcopy(reference).to(torch.bfloat16).model.get_image_features(
            pixels.to(torch.bfloat16), positions).pooler_output[0].float().numpy()
    params16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params)
    got = jax.jit(encode, static_argnums=1)(params16, cfg, im.pixels[None],
                                            encoder_inputs(cfg, im.position_ids[None]))
    assert got.dtype == jnp.bfloat16
    got = np.asarray(got[0, :im.num_tokens], np.float32)
    assert np.abs(got - want).max() <= 2 * np.abs(ref16 - want).max() + 1e-3
