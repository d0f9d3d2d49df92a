"""What the text model gets from the image side, checked end to end against transformers'
full vision-language forward (tiny random checkpoints, float32): the JAX tower's
embeddings put in place of the image tokens' embeddings, with Qwen's mrope positions
(models/vision/mrope.py) or Gemma 4's sliding-layer mask (models/vision/gemma4_mask.py),
through transformers' own text model, give its last hidden states within 1e-4; and the
image-side contract matters (plain positions / a plain causal mask do not)."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from PIL import Image

from models.vision import gemma4_vision, qwen3_5_vision
from models.vision.gemma4_mask import image_blocks, sliding_mask
from models.vision.mrope import mrope_positions
from models.vision.processing import ImageTokens, expand_image_tokens, preprocess
from tests.checkpoints import make_tiny_vision_checkpoint, model_class

ATOL = 1e-4


def image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def load(kind: str, path: str):
    return model_class(kind).from_pretrained(path, dtype=torch.float32).eval()


# ---- Qwen3.5 ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from transformers import Qwen2VLImageProcessorPil
    path = make_tiny_vision_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen_contract"),
                                       vision=dict(depth=2, num_position_embeddings=36))
    with open(f"{path}/config.json") as f:
        cfg = qwen3_5_vision.QwenVisionConfig.from_hf(json.load(f)["vision_config"])
    proc = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, size={"shortest_edge": 1024,
                                                                          "longest_edge": 64 * 1024})
    return cfg, qwen3_5_vision.load_params(path, cfg), load("qwen3_5", path), proc


def test_qwen_text_model_sees_embeddings_and_mrope(qwen):
    cfg, params, model, proc = qwen
    image_token = 200    # inside the tiny vocabulary (the published id is 248056)
    model.config.image_token_id = image_token
    images = preprocess(proc, "qwen3_5", [image(64, 96, 0), image(150, 70, 1)])
    prompt = [1, 5, 6, 190, image_token, 191, 7, 8, 190, image_token, 191, 9, 10, 11]
    ids = expand_image_tokens(prompt, images, ImageTokens(image=image_token))
    grids = [im.grid for im in images]
    pixels = np.concatenate([im.pixels for im in images])
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        want = model.model(input_ids=input_ids, pixel_values=torch.from_numpy(pixels),
                           image_grid_thw=torch.tensor(grids),
                           mm_token_type_ids=(input_ids == image_token).int()).last_hidden_state[0]
    rows = np.asarray(jax.jit(qwen3_5_vision.encode, static_argnums=1)(
        params, cfg, pixels, qwen3_5_vision.encoder_inputs(cfg, grids)))
    positions, _ = mrope_positions(ids, grids, image_token, cfg.spatial_merge_size)

    def text_model(pos: np.ndarray) -> np.ndarray:
        lm = model.model.language_model
        with torch.no_grad():
            embeds = lm.embed_tokens(input_ids)
            embeds[input_ids == image_token] = torch.tensor(rows)
            return lm(inputs_embeds=embeds, position_ids=torch.tensor(pos)[:, None]).last_hidden_state[0].numpy()

    np.testing.assert_allclose(text_model(positions), want.numpy(), atol=ATOL, rtol=0)
    plain = np.broadcast_to(np.arange(len(ids)), (3, len(ids)))
    assert np.abs(text_model(plain) - want.numpy()).max() > 100 * ATOL


# ---- Gemma 4 ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from transformers import Gemma4ImageProcessorPil
    path = make_tiny_vision_checkpoint("gemma4_vl", tmp_path_factory.mktemp("gemma_contract"),
                                       vision=dict(num_hidden_layers=2, standardize=True,
                                                   position_embedding_size=64),
                                       use_bidirectional_attention="vision")
    with open(f"{path}/config.json") as f:
        cfg = gemma4_vision.GemmaVisionConfig.from_hf(json.load(f))
    return cfg, gemma4_vision.load_params(path, cfg), load("gemma4_vl", path), Gemma4ImageProcessorPil(max_soft_tokens=70)


def test_gemma4_text_model_sees_soft_tokens_and_image_blocks(gemma):
    cfg, params, model, proc = gemma
    boi, image_token, eoi = 201, 200, 202
    model.config.image_token_id = image_token
    window = model.config.text_config.sliding_window
    images = preprocess(proc, "gemma4", [image(64, 96, 0), image(150, 40, 1)])
    assert min(im.num_tokens for im in images) > window     # the window cuts inside an image
    prompt = [1, 5, 6, image_token, 7, 8, 9, image_token, 10, 11]
    ids = expand_image_tokens(prompt, images, ImageTokens(image=image_token, start=boi, end=eoi))
    pixels = np.stack([im.pixels for im in images])
    positions = np.stack([im.position_ids for im in images])
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        want = model.model(input_ids=input_ids, pixel_values=torch.from_numpy(pixels),
                           image_position_ids=torch.from_numpy(positions),
                           mm_token_type_ids=(input_ids == image_token).int()).last_hidden_state[0].numpy()
    soft = np.asarray(jax.jit(gemma4_vision.encode, static_argnums=1)(
        params, cfg, pixels, gemma4_vision.encoder_inputs(cfg, positions)))
    rows = np.concatenate([s[:im.num_tokens] for s, im in zip(soft, images)])
    n = len(ids)
    causal = np.tril(np.ones((n, n), bool))

    def text_model(sliding: np.ndarray) -> np.ndarray:
        lm = model.model.language_model
        pad = model.config.text_config.pad_token_id
        with torch.no_grad():
            embeds = lm.embed_tokens(torch.where(input_ids == image_token, pad, input_ids))
            embeds[input_ids == image_token] = torch.tensor(rows)
            masks = {"full_attention": torch.from_numpy(causal)[None, None],
                     "sliding_attention": torch.from_numpy(sliding)[None, None]}
            return lm(inputs_embeds=embeds, attention_mask=masks,
                      position_ids=torch.arange(n)[None]).last_hidden_state[0].numpy()

    blocks = image_blocks(ids, image_token)
    np.testing.assert_allclose(text_model(sliding_mask(blocks, window)), want, atol=ATOL, rtol=0)
    plain = sliding_mask(np.full(n, -1), window)            # causal sliding window, no blocks
    assert np.abs(text_model(plain) - want).max() > 100 * ATOL


def test_gemma4_mask_chunks_and_blocks():
    ids = [1, 9, 9, 9, 2, 9, 9, 3]
    blocks = image_blocks(ids, 9)
    assert blocks.tolist() == [-1, 0, 0, 0, -1, 1, 1, -1]
    full = sliding_mask(blocks, 2)
    assert full[1, 3] and full[3, 2] and not full[3, 1]      # both ways inside an image, window behind
    assert not full[4, 5] and not full[3, 5]                 # never into a later image or text
    # a chunk starting at position 5 (cached prefix 0..4) sees what the whole prompt would
    np.testing.assert_array_equal(sliding_mask(blocks, 2, first_position=5), full[5:])


@pytest.mark.parametrize("family", ["qwen", "gemma"])
def test_tower_packs_buckets_and_unpacks_per_image(family, qwen, gemma):
    """VisionTower: images packed into a padded bucket, encoded in one call, unpacked per
    image, equal the images encoded alone without padding."""
    from models.vision.tower import VisionTower
    cfg, params, model, proc = qwen if family == "qwen" else gemma
    config = model.config.to_dict()
    tower = VisionTower.from_config(config)
    assert tower.config == cfg
    images = preprocess(proc, tower.family, [image(64, 96, 0), image(150, 40, 1)])
    encode = jax.jit(tower.encode)     # the tower (its config) is static
    bucket = tower.bucket_size(images) + (8 if family == "qwen" else 1)
    together = tower.unpack(np.asarray(encode(params, *tower.pack(images, bucket))), images)
    for im, got in zip(images, together):
        alone = tower.unpack(np.asarray(encode(params, *tower.pack([im], tower.bucket_size([im])))), [im])[0]
        assert got.shape == (im.num_tokens, model.config.text_config.hidden_size)
        np.testing.assert_allclose(got, alone, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="bucket"):
        tower.pack(images, tower.bucket_size(images) - 1)
