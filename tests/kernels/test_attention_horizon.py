"""Gemma 4's image mask in the attention (horizon: an image token sees its whole image,
the window bounding only the past side), in the reference and the XLA page loop, against
the float64 oracle and against models/vision/gemma4_mask.sliding_mask, the mask
transformers' model was checked with."""
from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from models.vision.gemma4_mask import image_blocks, sliding_mask
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from tests.kernels.rpa_cases import make_batch, oracle, tolerance

PAGE, WINDOW = 8, 8
# (q_len, kv_len) and each request's image spans (start, end) in positions: a fresh
# prefill with two images, a chunk after a cached prefix holding one (longer than the
# window), and a decode.
REQS = [(30, 30), (24, 40), (1, 50)]
IMAGES = [[(3, 9), (12, 20)], [(22, 35)], []]


def horizons(reqs, images, num_tokens) -> np.ndarray:
    h = np.zeros(num_tokens, np.int32)
    t = 0
    for (q_len, kv_len), spans in zip(reqs, images):
        pos = np.arange(kv_len - q_len, kv_len)
        last = pos.copy()
        for lo, hi in spans:
            last[(pos >= lo) & (pos < hi)] = hi - 1
        h[t:t + q_len] = last
        t += q_len
    return h


@pytest.mark.parametrize("impl,interpret", [("reference", False), ("xla", False),
                                            ("pallas", "tpu")])
def test_image_tokens_see_their_whole_image(impl, interpret):
    """pallas/tpu: the TPU kernel in TPU interpret mode."""
    b = make_batch(REQS, page_size=PAGE, num_kv_heads=2, group=2, head_dim=16,
                   num_tokens=64, num_rows=4, pages_per_req=8, sliding_window=WINDOW)
    h = horizons(REQS, IMAGES, 64)
    got = np.asarray(ragged_paged_attention(*b.args(), sm_scale=0.5, sliding_window=WINDOW,
                                            impl=impl, interpret=interpret,
                                            horizon=jnp.asarray(h)))
    want = oracle(b, sm_scale=0.5, sliding_window=WINDOW, horizon=h)
    np.testing.assert_allclose(got, want, **tolerance(jnp.float32))
    causal = oracle(b, sm_scale=0.5, sliding_window=WINDOW)
    assert np.abs(want - causal).max() > 1e-2      # the horizon changes image tokens


def test_gpu_kernel_takes_the_horizon():
    """The Mosaic GPU kernel (GPU interpret mode: bf16, head_dim 64) against the oracle."""
    b = make_batch(REQS, page_size=PAGE, num_kv_heads=2, group=2, head_dim=64,
                   num_tokens=64, num_rows=4, pages_per_req=8, sliding_window=WINDOW,
                   dtype=jnp.bfloat16)
    h = horizons(REQS, IMAGES, 64)
    got = np.asarray(ragged_paged_attention(*b.args(), sm_scale=0.125, sliding_window=WINDOW,
                                            impl="pallas", interpret="gpu",
                                            horizon=jnp.asarray(h))).astype(np.float32)
    want = oracle(b, sm_scale=0.125, sliding_window=WINDOW, horizon=h)
    np.testing.assert_allclose(got, want, **tolerance(jnp.bfloat16))
    causal = oracle(b, sm_scale=0.125, sliding_window=WINDOW)
    assert np.abs(want - causal).max() > 5e-2


def test_horizon_is_gemma4s_sliding_mask():
    """The oracle's rule with these horizons is sliding_mask's (the chunk of request 1)."""
    q_len, kv_len = REQS[1]
    ids = np.zeros(kv_len, np.int64)
    for lo, hi in IMAGES[1]:
        ids[lo:hi] = 9
    mask = sliding_mask(image_blocks(ids, 9), WINDOW, first_position=kv_len - q_len)
    pos = np.arange(kv_len - q_len, kv_len)
    last = horizons(REQS[1:2], IMAGES[1:2], q_len)
    kv = np.arange(kv_len)[None, :]
    rule = (kv <= last[:, None]) & (kv > pos[:, None] - WINDOW)
    np.testing.assert_array_equal(rule, mask)
