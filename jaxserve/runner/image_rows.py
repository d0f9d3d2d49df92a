"""The persistent batch's image side: per held row, its images' spans and Qwen's 3-axis
positions; per step, each token's row in the encoder cache and its 3-axis position.

The encoder cache's rows of each image (by content hash) mirror the scheduler's
decisions (SchedulerOutput.encoder_jobs / encoder_frees, core/encoder_cache.py): a
chunk that reaches an image token is only scheduled once the image is encoded.

Qwen3.5/3.6 (mrope): a prompt's positions come from models/vision/mrope.py, computed
when its row is added and kept with the row; every later token (generated, or past the
prompt of a resumed request) is at index + delta on all three axes. A row without
images has delta 0: its three axes are the plain position.

Gemma 4 (image_attention_both_ways): each token's horizon, the last position it sees on
the sliding layers: an image token's image's last position, any other token's own.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxserve.core.encoder_cache import EncoderJob
from models.vision.mrope import mrope_positions


class ImageRows:
    """mrope: (image token id, spatial merge size) when the model takes 3-axis positions
    (Qwen3.5/3.6), else None; horizon: the step carries image_horizon (Gemma 4)."""

    def __init__(self, max_num_seqs: int, mrope: tuple[int, int] | None,
                 horizon: bool = False):
        self.mrope, self.horizon = mrope, horizon
        # Per row: its images as (offset, length, content hash), and its prompt's 3-axis
        # positions int32[3, prompt] (None: a row without images).
        self.spans: list[tuple[tuple[int, int, str], ...]] = [()] * max_num_seqs
        self.positions: list[np.ndarray | None] = [None] * max_num_seqs
        self.delta = np.zeros(max_num_seqs, np.int32)
        self.rows_of: dict[str, np.ndarray] = {}   # content hash -> its encoder-cache rows

    # ---- the scheduler's decisions ---------------------------------------------------------
    def apply(self, frees: Sequence[str], jobs: Sequence[EncoderJob]) -> None:
        for h in frees:
            self.rows_of.pop(h, None)
        for job in jobs:
            self.rows_of[job.image.content_hash] = np.asarray(job.rows, np.int32)

    # ---- rows --------------------------------------------------------------------------
    def add(self, row: int, prompt_token_ids: Sequence[int], multi_modal: Any) -> None:
        images = () if multi_modal is None else multi_modal.images
        self.spans[row] = tuple((im.offset, im.length, im.content_hash) for im in images)
        self.positions[row], self.delta[row] = None, 0
        if images and self.mrope is not None:
            image_token, merge = self.mrope
            pos, delta = mrope_positions(prompt_token_ids, [im.processed.grid for im in images],
                                         image_token, merge)
            self.positions[row], self.delta[row] = pos.astype(np.int32), delta

    def move(self, src: int, dst: int) -> None:
        self.spans[dst], self.positions[dst] = self.spans[src], self.positions[src]
        self.delta[dst] = self.delta[src]
        self.clear(src)

    def clear(self, row: int) -> None:
        self.spans[row], self.positions[row], self.delta[row] = (), None, 0

    # ---- one step ------------------------------------------------------------------------
    def step_inputs(self, rows: np.ndarray, cu: np.ndarray, row_of_token: np.ndarray,
                    positions: np.ndarray, t: int) -> dict[str, np.ndarray]:
        """The step's ModelInputs image fields for its tokens (the first len(positions)
        of t; cu: each batch row's first token): image_rows int32[t] (-1: text), for an
        mrope model mrope_positions int32[3, t], with horizon image_horizon int32[t]."""
        n = len(positions)
        image_rows = np.full(t, -1, np.int32)
        out = {"image_rows": image_rows}
        if self.horizon:
            horizon = out["image_horizon"] = np.zeros(t, np.int32)
            horizon[:n] = positions
        if self.mrope is not None:
            mrope = np.zeros((3, t), np.int32)
            mrope[:, :n] = positions + self.delta[row_of_token]
            out["mrope_positions"] = mrope
        for i, row in enumerate(rows):
            if not self.spans[row]:
                continue
            a, b = int(cu[i]), int(cu[i + 1])
            pos = positions[a:b]
            if self.mrope is not None:
                prompt = self.positions[row]
                inside = pos < prompt.shape[1]
                mrope[:, a:b][:, inside] = prompt[:, pos[inside]]
            for offset, length, h in self.spans[row]:
                sel = (pos >= offset) & (pos < offset + length)
                if sel.any():
                    image_rows[a:b][sel] = self.rows_of[h][pos[sel] - offset]
                    if self.horizon:
                        horizon[a:b][sel] = offset + length - 1
        return out
