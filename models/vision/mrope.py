"""Qwen3.5 / 3.6's multi-axis rotary positions (mrope) for a prompt holding images.

Text tokens get one position on all three axes (temporal, row, column), counting on from
the previous token. An image's <|image_pad|> tokens (one per 2x2 merged patch block,
raster order over the merged grid) all start at the running position `p`: temporal p
(+ frame index), row p + its block row, column p + its block column; after the image the
count resumes at p + max(rows, columns) (transformers' Qwen3_5Model.get_rope_index: its
advance is max(h, w) // merge, not that plus one). Generated tokens continue on all axes at
index + delta, delta = (largest prompt position + 1) - prompt length.

The text model rotates with these three rows interleaved over the rotary frequencies
(mrope_interleaved: frequency i follows the row axis if i % 3 == 1 and i < 3 * section[1],
the column axis if i % 3 == 2 and i < 3 * section[2], else the temporal axis); for a prompt
without images every row is the plain position, which is why text-only serving needs none
of this.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mrope_positions(token_ids: Sequence[int], image_grids: Sequence[tuple[int, int, int]],
                    image_token_id: int, spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """Positions [3, len(token_ids)] (int64) of a prompt whose runs of `image_token_id`
    hold the images of `image_grids` (the processor's (t, h, w) patch grids, in order),
    and the delta that continues them for generated tokens."""
    ids = np.asarray(token_ids)
    m = spatial_merge_size
    out = np.empty((3, len(ids)), np.int64)
    grids = list(image_grids)
    pos = i = g = 0
    while i < len(ids):
        if ids[i] != image_token_id:
            out[:, i] = pos
            pos, i = pos + 1, i + 1
            continue
        if g == len(grids):
            raise ValueError(f"image token at index {i} beyond the {len(grids)} image grid(s) given")
        t, h, w = grids[g]
        if h % m or w % m:
            raise ValueError(f"image grid {h}x{w} is not a multiple of the merge size {m}")
        rows, cols = h // m, w // m
        n = t * rows * cols
        if i + n > len(ids) or np.any(ids[i:i + n] != image_token_id):
            raise ValueError(f"image {g} needs {n} image tokens from index {i}; the prompt has fewer")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols), indexing="ij")
        out[:, i:i + n] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + pos
        pos, i, g = pos + max(rows, cols), i + n, g + 1
    if g != len(grids):
        raise ValueError(f"{len(grids)} image grids given but the prompt holds {g} image(s)")
    delta = int(out.max()) + 1 - len(ids) if len(ids) else 0
    return out, delta
