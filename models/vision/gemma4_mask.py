"""Gemma 4's attention mask around images (use_bidirectional_attention == "vision"):
the reference the attention kernels must reproduce (docs/VISION.md).

Each maximal run of image tokens is a block (<|image>/<image|> around it are text). On
sliding-window layers a query sees a key if the key is not in the future or lies in the
query's own image block, and in both cases is less than `sliding_window` positions back;
global layers stay causal; decode steps add nothing (a generated token is text).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def image_blocks(token_ids: Sequence[int], image_token_id: int) -> np.ndarray:
    """Per token: the index of the run of image tokens it is in, -1 for other tokens."""
    is_image = np.asarray(token_ids) == image_token_id
    starts = is_image & ~np.concatenate([[False], is_image[:-1]])
    return np.where(is_image, np.cumsum(starts) - 1, -1)


def sliding_mask(blocks: np.ndarray, sliding_window: int, first_position: int = 0) -> np.ndarray:
    """[Q, L] bool mask of a chunk of queries at positions first_position + i over keys
    0..L-1 (L = first_position + Q: the cached prefix and the chunk), `blocks` the block
    ids of all L tokens. A chunk must hold every image whose block it touches."""
    blocks = np.asarray(blocks)
    q = np.arange(first_position, len(blocks))[:, None]
    kv = np.arange(len(blocks))[None, :]
    same_image = (blocks[q] == blocks[kv]) & (blocks[q] >= 0)
    return ((kv <= q) | same_image) & (kv > q - sliding_window)
