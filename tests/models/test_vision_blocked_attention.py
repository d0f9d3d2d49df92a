"""The towers' attention in blocks of queries (models/vision/common.attention): the same
result as the whole [heads, patches, patches] softmax, for a grouped-query attention
with segments, padding and a leading batch, and for both towers' `encode`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.vision import common
from models.vision.common import attention, query_block
from models.vision.tower import VisionTower
from tests.checkpoints import make_tiny_vision_checkpoint

WHOLE = 10 ** 9   # a block larger than any sequence here: the unblocked attention


def test_query_blocks_are_equal_and_cover_the_queries():
    assert query_block(1000, 1024) == 1000
    assert query_block(2048, 1024) == 1024
    assert query_block(2520, 1024) == 840
    assert query_block(37, 8) == 8          # 5 blocks of 8 cover 37: 3 padding queries


@pytest.mark.parametrize("t, block", [(32, 8), (37, 8), (37, 36)])
def test_blocked_is_the_unblocked_attention(t, block):
    """Two sequences of t patches, 4 query heads over 2 KV heads; the first holds two
    segments and padding (patches that see nothing), as Qwen packs images."""
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, t, 4, 16), jnp.float32)
    k = jax.random.normal(kk, (2, t, 2, 16), jnp.float32)
    v = jax.random.normal(kv, (2, t, 2, 16), jnp.float32)
    seg = np.stack([np.r_[np.zeros(t // 2), np.ones(t - t // 2 - 3), -np.ones(3)],
                    np.zeros(t)]).astype(np.int32)
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] >= 0)
    whole = attention(q, k, v, jnp.asarray(mask), 0.25, block=WHOLE)
    blocked = jax.jit(attention, static_argnums=(4, 5))(q, k, v, jnp.asarray(mask), 0.25,
                                                        block)
    assert blocked.shape == whole.shape
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(whole), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind, bucket, max_tokens", [("qwen3_5", 256, 64),
                                                      ("gemma4_vl", 2, 70)])
def test_both_towers_encode_the_same_in_blocks(kind, bucket, max_tokens, tmp_path,
                                               monkeypatch):
    """encode at a bucket of several blocks (of at most 64 queries: Qwen's 256 patches,
    Gemma 4's 630 patches an image, two images) against one block."""
    path = make_tiny_vision_checkpoint(kind, tmp_path)
    tower = VisionTower.from_pretrained(path)
    params = tower.load_params(path, jnp.float32)
    images = tower.warmup_images(bucket, max_tokens)
    rng = np.random.default_rng(0)
    for im in images:   # the warmup images' pixels are zeros: give them content
        im.pixels[...] = rng.uniform(size=im.pixels.shape).astype(im.pixels.dtype)
    pixels, inputs = tower.pack(images, bucket)
    out = {}
    for block in (WHOLE, 64):
        monkeypatch.setattr(common, "QUERY_BLOCK", block)
        out[block] = np.asarray(jax.jit(tower.encode)(params, pixels, inputs))
    np.testing.assert_allclose(out[64], out[WHOLE], rtol=1e-5, atol=1e-5)
