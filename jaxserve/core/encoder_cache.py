"""The scheduler's side of the encoder cache: which image embeddings the runner holds,
in which rows of its device buffer, and which images a step encodes.

The runner keeps one buffer of `num_rows` embedding rows (runner/image_encoder.py); an
image's embeddings take `length` rows of it (any rows: a free list, like pages), keyed
by the image's content hash, so an image repeated in a prompt, in a later turn or in
another request is encoded once while it stays cached. A request holds each image it
has not finished computing (so its rows are not handed to another image while a step
may still read them); an image no request holds stays cached until its rows are
needed (least recently used first). Each step encodes at most `budget` rows' worth of
new images: the scheduler encodes an image when its span first enters a scheduled
chunk and cuts the chunk before an image that does not fit (chunked prefill then
continues across it in a later step). The runner mirrors this from SchedulerOutput's
encoder_jobs (encode this image into these rows) and encoder_frees (forget a hash).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from jaxserve.core.request import Request


@dataclass(frozen=True, slots=True)
class EncoderJob:
    """Encode `image` (its multimodal ImageInput: pixels, length, content hash) into
    these rows of the runner's encoder cache."""
    image: Any
    rows: tuple[int, ...]


class _Entry:
    __slots__ = ("rows", "users")

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows
        self.users = 0


class EncoderCache:
    def __init__(self, num_rows: int, budget: int, whole_images: bool = False) -> None:
        if num_rows <= 0 or budget <= 0:
            raise ValueError(f"encoder cache rows and budget must be positive, got "
                             f"{num_rows} and {budget}")
        self.num_rows = num_rows
        self.budget = budget
        self.whole_images = whole_images   # a chunk never ends inside an image (Gemma 4)
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._entries: dict[str, _Entry] = {}
        self._unused: OrderedDict[str, None] = OrderedDict()   # LRU of entries no one holds
        # request id -> [(content hash, end of its span)] of the images it holds
        self._holds: dict[str, list[tuple[str, int]]] = {}
        self._jobs: list[EncoderJob] = []
        self._frees: list[str] = []
        self._step_rows = 0      # rows encoded in the step being scheduled
        self.num_encoded = 0     # images encoded, all steps (each hit saves one)
        self.num_hits = 0        # image spans that found their embeddings cached

    def fit(self, request: Request, start: int, num_new: int) -> int:
        """How many of the num_new tokens from `start` the step can compute given the
        images they reach: up to the first image that is neither cached nor fits this
        step's budget and the free (or evictable) rows (with whole_images, or that the
        chunk would end inside). Changes nothing."""
        reached = [im for im in request.images
                   if im.offset < start + num_new and im.offset + im.length > start]
        if not reached:
            return num_new
        hits = {im.content_hash for im in reached if im.content_hash in self._entries}
        budget = self.budget - self._step_rows
        spare = len(self._free_rows) + sum(len(self._entries[h].rows) for h in self._unused
                                           if h not in hits)
        for im in reached:
            if self.whole_images and start <= im.offset < start + num_new < im.offset + im.length:
                return im.offset - start
            if im.content_hash in hits:
                continue
            if im.length > budget or im.length > spare:
                return max(im.offset - start, 0)
            budget -= im.length
            spare -= im.length
            hits.add(im.content_hash)
        return num_new

    def commit(self, request: Request, start: int, num_new: int) -> None:
        """The request computes [start, start + num_new) this step (within fit's answer):
        it holds the images that range reaches, encoding those not cached, and lets go
        of those it finished computing in earlier steps."""
        rid, end = request.request_id, start + num_new
        holds = self._holds.setdefault(rid, [])
        for h, span_end in [x for x in holds if x[1] <= start]:
            holds.remove((h, span_end))
            self._let_go(h)
        held = {h for h, _ in holds}
        for im in request.images:
            h = im.content_hash
            if im.offset >= end or im.offset + im.length <= start or h in held:
                continue
            entry = self._entries.get(h)
            if entry is None:
                entry = self._encode(im)
            else:
                self.num_hits += 1
                self._unused.pop(h, None)
            entry.users += 1
            holds.append((h, im.offset + im.length))
            held.add(h)
        if not holds:
            del self._holds[rid]

    def release(self, request: Request) -> None:
        """The request finished or was preempted: it holds no image (they stay cached)."""
        for h, _ in self._holds.pop(request.request_id, ()):
            self._let_go(h)

    def take(self) -> tuple[list[EncoderJob], list[str]]:
        """The step's (encoder jobs, evicted hashes); a new step starts."""
        jobs, frees = self._jobs, self._frees
        self._jobs, self._frees, self._step_rows = [], [], 0
        return jobs, frees

    def _encode(self, image: Any) -> _Entry:
        while len(self._free_rows) < image.length:
            self._evict()
        rows = [self._free_rows.pop() for _ in range(image.length)]
        entry = self._entries[image.content_hash] = _Entry(rows)
        self._jobs.append(EncoderJob(image, tuple(rows)))
        self._step_rows += image.length
        self.num_encoded += 1
        return entry

    def _let_go(self, h: str) -> None:
        entry = self._entries[h]
        entry.users -= 1
        if not entry.users:
            self._unused[h] = None

    def _evict(self) -> None:
        """Drops the least recently used entry no one holds."""
        h, _ = self._unused.popitem(last=False)
        self._free_rows.extend(self._entries.pop(h).rows)
        # Encoded by this very step for a request preempted since: drop the job instead.
        job = next((j for j in self._jobs if j.image.content_hash == h), None)
        if job is None:
            self._frees.append(h)
        else:
            self._jobs.remove(job)
            self._step_rows -= len(job.rows)
            self.num_encoded -= 1
