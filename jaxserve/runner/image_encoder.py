"""The runner's vision tower: encoder programs and the encoder cache on device.

The encoder cache is one buffer of embedding rows [num_rows, E] (E: the text model's
hidden size); the scheduler decides which image goes into which rows
(core/encoder_cache.py) and the step's forward reads them by row
(ModelInputs.image_rows / image_embeds). An encoder program runs the tower on a padded
bucket of images and writes each output row into its cache row in the same program (the
cache donated, so in place; padding rows target row num_rows and are dropped).

Buckets (models/vision/tower.py): Qwen3.5/3.6 pads the patch count of the images packed
into one call (several images share a call, kept apart by segment id); Gemma 4 pads the
image count (its processor pads every image to the same patch count). Every bucket is
compiled in warmup, so no image the processor can produce compiles mid-serving.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from jaxserve.core.encoder_cache import EncoderJob
from jaxserve.runner.buckets import pick_bucket
from jaxserve.runner.programs import ENCODE, Program
from models.vision.tower import VisionTower
from sharding import replicated


@dataclass(frozen=True)
class VisionParts:
    """What serving images needs on the runner's side (build/vision.py loads it)."""
    tower: VisionTower
    params: Any                 # the tower's weights (on the default device)
    buckets: tuple[int, ...]    # what an encoder call pads to: patches (Qwen) or images (Gemma 4)
    num_rows: int               # the encoder cache's embedding rows
    budget: int                 # the most rows a step encodes (the scheduler's)
    max_tokens: int             # the most rows one image takes (its processor's)


class ImageEncoder:
    def __init__(self, parts: VisionParts, *, hidden_size: int, dtype: Any, mesh: Any,
                 abstract: bool = False):
        self.tower, self.buckets, self.num_rows = parts.tower, parts.buckets, parts.num_rows
        self.max_tokens = parts.max_tokens
        rep = replicated(mesh)
        shape = (parts.num_rows, hidden_size)
        if abstract:
            self.params = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), parts.params)
            self.cache = jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
        else:
            self.params = jax.device_put(parts.params, rep)
            self.cache = jax.device_put(jnp.zeros(shape, dtype), rep)
        self._encode = jax.jit(self._encode_fn, donate_argnums=(1,),
                               in_shardings=(rep, rep, rep, rep, rep), out_shardings=rep)

    def _encode_fn(self, params, cache, pixels, inputs, dest):
        """The tower on one padded bucket, its rows written into the cache at dest
        (int32[rows out]; num_rows: a padding row, dropped)."""
        out = self.tower.encode(params, pixels, inputs)
        out = out.reshape(-1, out.shape[-1]).astype(cache.dtype)
        return cache.at[dest].set(out, mode="drop")

    # ---- serving -------------------------------------------------------------------------
    def run(self, jobs: Sequence[EncoderJob]) -> None:
        """Encodes the step's images into their rows, as few calls as the largest bucket
        allows (in job order)."""
        calls: list[list[EncoderJob]] = []
        size = 0
        for job in jobs:
            n = self.tower.bucket_size([job.image.processed])
            if not calls or size + n > self.buckets[-1]:
                calls.append([])
                size = 0
            calls[-1].append(job)
            size += n
        for call in calls:
            self.cache = self._encode(self.params, self.cache, *self._call_args(call))

    def _call_args(self, jobs: list[EncoderJob]) -> tuple:
        images = [j.image.processed for j in jobs]
        bucket = pick_bucket(self.buckets, self.tower.bucket_size(images))
        pixels, inputs = self.tower.pack(images, bucket)
        return pixels, inputs, self.tower.out_rows(images, [j.rows for j in jobs], bucket,
                                                   self.max_tokens, self.num_rows)

    # ---- warmup ----------------------------------------------------------------------
    def programs(self) -> list[Program]:
        """One encoder program per bucket, with zero pixels (what serving passes but the
        pixel values)."""
        return [Program(ENCODE, self._encode, partial(self._warmup_args, b), tokens=b)
                for b in self.buckets]

    def _warmup_args(self, bucket: int) -> tuple:
        images = self.tower.warmup_images(bucket, self.max_tokens)
        dest = self.tower.out_rows(images, [()] * len(images), bucket, self.max_tokens,
                                   self.num_rows)
        return (self.params, self.cache, *self.tower.pack(images, bucket), dest)
