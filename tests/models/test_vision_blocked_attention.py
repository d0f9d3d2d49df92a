"""The towers' attention in tiles of queries x keys (models/vision/common.attention,
flash-style online softmax): the same result as the whole [heads, patches, patches]
softmax, for a grouped-query attention with segments, padding and a leading batch, at
sizes that are and are not multiples of the block, and for both towers' `encode` on
several images of different sizes in one call."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.vision import common
from models.vision.common import attention, query_block
from models.vision.processing import ProcessedImage
from models.vision.tower import VisionTower
from tests.checkpoints import make_tiny_vision_checkpoint

WHOLE = 10 ** 9   # a block larger than any sequence here: the unblocked attention


def test_blocks_are_equal_and_cover_the_patches():
    assert query_block(1000, 1024) == 1000
    assert query_block(2048, 1024) == 1024
    assert query_block(2520, 1024) == 840
    assert query_block(37, 8) == 8          # 5 blocks of 8 cover 37: 3 padding patches


def oracle(q, k, v, q_seg, k_seg, scale):
    """float64 numpy: the whole masked softmax (a query that sees no key averages all)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[-2] // k.shape[-2]
    k, v = np.repeat(k, groups, axis=-2), np.repeat(v, groups, axis=-2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    mask = (q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg[:, None, :] >= 0)
    logits = np.where(mask[:, None], logits, np.finfo(np.float32).min)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bnts,bsnh->btnh", probs / probs.sum(-1, keepdims=True), v)


# (32, 8): a multiple of the block; (37, 8): 5 tiles a side, 3 padding keys and queries;
# (37, 36): 2 of 19; (20, 8) with segment 1 only in the last tile.
@pytest.mark.parametrize("t, block", [(32, 8), (37, 8), (37, 36), (20, 8)])
def test_blocked_is_the_unblocked_attention(t, block):
    """Two sequences of t patches, 4 query heads over 2 KV heads. The first packs two
    segments and padding (patches that see nothing), as Qwen packs images; the second,
    as Gemma 4 pads an image, has every query in one segment and its last keys padding."""
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, t, 4, 16), jnp.float32)
    k = jax.random.normal(kk, (2, t, 2, 16), jnp.float32)
    v = jax.random.normal(kv, (2, t, 2, 16), jnp.float32)
    first = t // 2 if t != 20 else 17
    packed = np.r_[np.zeros(first), np.ones(t - first - 3), -np.ones(3)]
    q_seg = np.stack([packed, np.zeros(t)]).astype(np.int32)
    k_seg = np.stack([packed, np.r_[np.zeros(t - 5), -np.ones(5)]]).astype(np.int32)
    want = oracle(q, k, v, q_seg, k_seg, 0.25)
    whole = attention(q, k, v, jnp.asarray(q_seg), jnp.asarray(k_seg), 0.25, block=WHOLE)
    blocked = jax.jit(attention, static_argnums=(5, 6))(q, k, v, q_seg, k_seg, 0.25, block)
    assert blocked.shape == whole.shape == want.shape
    for got in (whole, blocked):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(whole), rtol=1e-6, atol=1e-6)


def test_blocked_in_bfloat16_stays_near_float32():
    """Serving's dtype: the tiles' probabilities meet v in bfloat16, as the whole path's."""
    kq, kk, kv = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(key, (1, 37, 2, 16), jnp.float32) for key in (kq, kk, kv))
    seg = jnp.zeros((1, 37), jnp.int32)
    want = oracle(q, k, v, np.zeros((1, 37)), np.zeros((1, 37)), 0.25)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    blocked = attention(*bf, seg, seg, 0.25, block=8)
    assert blocked.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(blocked, np.float32), want, atol=0.05)


def several_images(tower: VisionTower, rng: np.random.Generator) -> tuple[list, int]:
    """Images of different sizes for one call, and its bucket: Qwen three images packed
    by segment (16 x 8, 6 x 10, 4 x 4 patches: 204) and 52 padding patches; Gemma 4
    three images of 630-patch slots with 630, 405 and 81 real patches, and a padding
    image (bucket 4)."""
    cfg = tower.config
    if tower.family == "gemma4":
        images = []
        for rows, cols in ((21, 30), (15, 27), (9, 9)):
            pos = np.full((630, 2), -1, np.int32)
            c, r = np.meshgrid(np.arange(cols), np.arange(rows))
            pos[:rows * cols] = np.stack([c.ravel(), r.ravel()], 1)
            images.append(ProcessedImage(rng.uniform(size=(630, 3 * cfg.patch_size ** 2)).astype(np.float32),
                                         rows * cols // 9, position_ids=pos))
        return images, 4
    return [ProcessedImage(rng.uniform(size=(h * w, cfg.patch_dim)).astype(np.float32),
                           h * w // 4, grid=(1, h, w)) for h, w in ((16, 8), (6, 10), (4, 4))], 256


@pytest.mark.parametrize("kind", ["qwen3_5", "gemma4_vl"])
def test_both_towers_encode_the_same_in_blocks(kind, tmp_path, monkeypatch):
    """encode of several images of different sizes in one call, in tiles of at most 64
    patches (Qwen's 256-patch bucket in 4 x 4 tiles; Gemma 4's 630-patch images in 10 x 10
    tiles of 63) against one block; each image's rows alone in the call equal its rows
    beside the others (no attention across images)."""
    path = make_tiny_vision_checkpoint(kind, tmp_path)
    tower = VisionTower.from_pretrained(path)
    params = tower.load_params(path, jnp.float32)
    images, bucket = several_images(tower, np.random.default_rng(0))
    pixels, inputs = tower.pack(images, bucket)
    out = {}
    for block in (WHOLE, 64):
        monkeypatch.setattr(common, "QUERY_BLOCK", block)
        out[block] = np.asarray(jax.jit(tower.encode)(params, pixels, inputs))
    np.testing.assert_allclose(out[64], out[WHOLE], rtol=1e-5, atol=1e-5)
    alone = np.asarray(jax.jit(tower.encode)(params, *tower.pack(images[1:2], bucket)))
    got = tower.unpack(out[64], images)[1]
    np.testing.assert_allclose(got, tower.unpack(alone, images[1:2])[0], rtol=1e-5, atol=1e-5)


def test_tiles_no_query_sees_are_skipped():
    """Four images packed one per block: a query block runs only its own image's key tile.
    Another image's V poisoned with NaN reaches no other image's output (a computed tile
    would add 0 * NaN), and the blocks holding a padding query (which averages every key)
    still run every tile, as the whole softmax does."""
    rng = np.random.default_rng(0)
    t, n, h, size = 32, 2, 4, 8
    q, k, v = (jnp.asarray(rng.standard_normal((t, n, h)), jnp.float32) for _ in range(3))
    seg = jnp.asarray(np.repeat(np.arange(4), size), jnp.int32)
    v = v.at[3 * size:].set(jnp.nan)                              # image 3's values
    out = np.asarray(attention(q, k, v, seg, seg, 0.5, block=size))
    finite = jnp.nan_to_num(v)          # the oracle's whole softmax would spread the NaN
    want = oracle(q[None], k[None], finite[None], np.asarray(seg)[None], np.asarray(seg)[None],
                  0.5)[0]
    np.testing.assert_allclose(out[:3 * size], want[:3 * size], rtol=1e-5, atol=1e-5)
    assert np.isnan(out[3 * size:]).all()
    padded = seg.at[5].set(-1)              # a padding query in the first block
    out = np.asarray(attention(q, k, v, padded, padded, 0.5, block=size))
    assert np.isnan(out[5]).all()          # it averaged every key, image 3's NaN included
    assert np.isfinite(out[size:3 * size]).all()
