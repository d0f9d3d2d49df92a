"""The checkpoint's image side of the front door: whether it takes images at all, the
per-prompt image limit, the image processor (PIL backend, --mm-processor-kwargs) and the
placeholder expansion (models/vision/processing.py), giving the prompt's token ids and a
MultiModalInputs payload. Host only: no jax."""
from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from PIL import Image

from jaxserve.errors import ConfigError
from jaxserve.errors import InputError
from jaxserve.config.media import MediaConfig
from jaxserve.multimodal.media import load_image, to_rgb
from models.vision.processing import (ImageTokens, expand_image_tokens, load_image_processor,
                                      preprocess, vision_family)


# Threads that fetch and decode a request's images (shared by all requests).
_FETCH_THREADS = 8


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt: its tower inputs, where its placeholder tokens are, and a
    key for the encoder cache and the prefix cache (equal pixels under the same processor
    settings: equal key)."""
    processed: Any            # models.vision.processing.ProcessedImage
    offset: int               # index of its first placeholder token in the prompt
    length: int               # its placeholder tokens (= the tower's output rows)
    content_hash: str         # sha256 hex of the decoded pixels and processor settings


@dataclass(frozen=True)
class MultiModalInputs:
    images: tuple[ImageInput, ...]


def content_hash(image: Any, processor_kwargs: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(f"{image.mode} {image.size} ".encode())
    h.update(json.dumps(processor_kwargs, sort_keys=True, default=str).encode())
    h.update(image.tobytes())
    return h.hexdigest()


class ImageFront:
    """refusal: why this server takes no images (text-only model, --language-model-only,
    no image processor, an attention backend without the model's image mask:
    build/vision.py), or None. Any thread may call it."""

    def __init__(self, model_dir: str | None, model_config: dict[str, Any], media: MediaConfig,
                 refusal: str | None = None):
        self.model_dir = model_dir
        self.media = media
        self.refusal = refusal
        self._processor = None
        self._fetchers: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        if refusal is None:
            self.family = vision_family(model_config)
            self.tokens = ImageTokens.from_config(model_config)

    @classmethod
    def for_model(cls, model_dir: str, media: MediaConfig, *,
                  language_model_only: bool = False) -> ImageFront:
        """From a checkpoint directory (its config.json and preprocessor_config.json)."""
        try:
            with open(os.path.join(model_dir, "config.json")) as f:
                config = json.load(f)
        except (OSError, ValueError):
            config = {}
        refusal = None
        try:
            vision_family(config)
        except ValueError:
            refusal = (f"this model ({str(config.get('model_type', 'unknown'))[:40]}) takes "
                       f"text only")
        if refusal is None and language_model_only:
            refusal = ("the server runs the language model only (--language-model-only): "
                       "images are refused")
        if refusal is None and not os.path.exists(os.path.join(model_dir,
                                                               "preprocessor_config.json")):
            refusal = "the checkpoint has no image processor (preprocessor_config.json)"
        front = cls(model_dir, config, media, refusal)
        if refusal is None:
            front.processor()   # at start: bad --mm-processor-kwargs stop it here
        return front

    # ---- checks, then images -----------------------------------------------------------
    def check_count(self, n: int, field: str) -> None:
        """Refuses n images before any is fetched or decoded."""
        if n == 0:
            return
        if self.refusal is not None:
            raise InputError(f"this request has {n} image(s), but {self.refusal}", field)
        limit = self.media.max_images
        if n > limit:
            raise InputError(f"this request has {n} images; at most {limit} per prompt "
                             f"(--limit-mm-per-prompt '{{\"image\": N}}')", field)

    def load(self, urls: Sequence[str], field: str = "messages") -> list[Any]:
        """The images the URLs name, decoded (after the count check); several are
        fetched at once, so a request waits about one fetch time limit, not one per image."""
        self.check_count(len(urls), field)
        if len(urls) == 1:
            return [load_image(urls[0], self.media, field)]
        with self._lock:
            if self._fetchers is None:
                self._fetchers = ThreadPoolExecutor(_FETCH_THREADS, "image-fetch")
        return list(self._fetchers.map(lambda u: load_image(u, self.media, field), urls))

    def processor(self) -> Any:
        with self._lock:
            if self._processor is None:
                self._processor = _load_processor(self.model_dir, self.media.processor_kwargs)
            return self._processor

    def expand(self, token_ids: Sequence[int], images: Sequence[Any],
               field: str = "messages") -> tuple[list[int], MultiModalInputs]:
        """Prompt ids holding one image marker per image (as the chat template writes it)
        -> the ids with each marker expanded to the image's tokens, and the payload."""
        self.check_count(len(images), field)
        bad = [i for i, im in enumerate(images) if not isinstance(im, Image.Image)]
        if bad:
            raise InputError(f"image {bad[0]} is a {type(images[bad[0]]).__name__}, not a "
                             f"PIL image", field)
        images = [im if im.mode == "RGB" else to_rgb(im) for im in images]
        try:
            processed = preprocess(self.processor(), self.family, images)
        except ValueError as e:   # e.g. Qwen's smart_resize: aspect ratio over 200
            raise InputError(f"an image cannot be processed: {str(e)[:160]}", field) from None
        try:
            ids = expand_image_tokens(token_ids, processed, self.tokens)
        except ValueError as e:
            raise InputError(f"{e} (does the chat template write this model's image "
                             f"markers?)", field) from None
        spans, i = [], 0
        for p in processed:    # each image's run of image tokens, in order
            i = ids.index(self.tokens.image, i)
            spans.append((i, p.num_tokens))
            i += p.num_tokens
        kwargs = self.media.processor_kwargs
        return ids, MultiModalInputs(tuple(
            ImageInput(p, off, n, content_hash(im, kwargs))
            for p, (off, n), im in zip(processed, spans, images)))


# Processor settings fixed by the tower's weights (or by jaxserve): not for
# --mm-processor-kwargs.
_FIXED_KWARGS = frozenset({"patch_size", "merge_size", "temporal_patch_size",
                           "pooling_kernel_size", "return_tensors", "device", "data_format",
                           "input_data_format", "image_seq_length", "disable_grouping"})


def _load_processor(model_dir: str, kwargs: dict[str, Any]) -> Any:
    """The image processor with kwargs, each of which it must know (transformers drops
    unknown ones silently); ConfigError naming --mm-processor-kwargs otherwise."""
    try:
        processor = load_image_processor(model_dir, **kwargs)
    except Exception as e:  # noqa: BLE001 - a bad setting's error, whatever its type
        if not kwargs:
            raise
        raise ConfigError("mm_processor_kwargs", f"mm_processor_kwargs {str(kwargs)[:120]}: "
                          f"{type(e).__name__}: {str(e)[:120]}") from None
    known = set()
    for cls in getattr(processor, "valid_kwargs", object).__mro__:
        known |= set(getattr(cls, "__annotations__", {}))
    bad = sorted(k for k in kwargs if k not in known or k in _FIXED_KWARGS)
    if bad:
        raise ConfigError("mm_processor_kwargs", f"mm_processor_kwargs: {bad[0][:40]!r} is not "
                          f"a setting of {type(processor).__name__} that may change (e.g. "
                          f"{', '.join(sorted(known - _FIXED_KWARGS)[:8])})")
    return processor


def image_front(config: Any) -> ImageFront:
    """The image front of an EngineConfig (its model resolved to a directory)."""
    media = MediaConfig.from_settings(limit_mm_per_prompt=config.limit_mm_per_prompt,
                                      allowed_local_media_path=config.allowed_local_media_path,
                                      mm_processor_kwargs=config.mm_processor_kwargs)
    return ImageFront.for_model(config.model, media,
                                language_model_only=config.language_model_only)
