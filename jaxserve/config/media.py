"""The multimodal input settings, checked once (vLLM's flag names)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from jaxserve.errors import ConfigError

# Modalities jaxserve does not take at all; their limit may only be 0.
REFUSED_MODALITIES = ("video", "audio")
# Images per prompt when --limit-mm-per-prompt does not say (vLLM allows 999; jaxserve
# bounds the decoding work one request can ask for).
DEFAULT_IMAGE_LIMIT = 16
# vLLM's environment variable for the http(s) fetch time limit, in seconds (its default).
FETCH_TIMEOUT_ENV, DEFAULT_FETCH_TIMEOUT_S = "VLLM_IMAGE_FETCH_TIMEOUT", 5.0
# jaxserve's own: the most bytes one image may have (fetched, read or decoded from base64).
MAX_BYTES_ENV, DEFAULT_MAX_IMAGE_BYTES = "JAXSERVE_MAX_IMAGE_BYTES", 20 * 2**20
# Decoded pixels per image (width x height): a small file can decode to a huge bitmap.
MAX_IMAGE_PIXELS = 50_000_000


def image_limit(limit_mm_per_prompt: dict[str, Any] | None) -> int:
    """The image limit of --limit-mm-per-prompt ({"image": N} or {"image": {"count": N}});
    ConfigError naming the flag for a modality jaxserve refuses or a bad value."""
    limits = limit_mm_per_prompt or {}
    if not isinstance(limits, dict):
        raise ConfigError("limit_mm_per_prompt", f"limit_mm_per_prompt must be a JSON object "
                          f"such as {{\"image\": 4}}, got {limits!r:.80}")
    count = DEFAULT_IMAGE_LIMIT
    for modality, value in limits.items():
        if isinstance(value, dict):
            if set(value) - {"count"}:
                raise ConfigError("limit_mm_per_prompt", f"limit_mm_per_prompt[{modality!r}]: "
                                  f"only 'count' is taken, got {sorted(value)!r:.80}")
            value = value.get("count", 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError("limit_mm_per_prompt", f"limit_mm_per_prompt[{modality!r}] must "
                              f"be a count >= 0, got {value!r:.40}")
        if modality == "image":
            count = value
        elif value != 0:
            why = ("video and audio inputs are not served" if modality in REFUSED_MODALITIES
                   else "jaxserve knows only 'image'")
            raise ConfigError("limit_mm_per_prompt", f"limit_mm_per_prompt[{modality!r:.40}]"
                              f"={value}: {why}; only 0 is taken")
    return count


def _env_number(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(name, f"{name}={text!r:.40} is not a number") from None
    if not value > 0:
        raise ConfigError(name, f"{name}={text!r:.40} must be > 0")
    return value


@dataclass(frozen=True)
class MediaConfig:
    """What a request's images may be and where they may come from."""
    max_images: int = DEFAULT_IMAGE_LIMIT
    allowed_local_media_path: str = ""    # '' : file:// URLs are refused
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
    processor_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, *, limit_mm_per_prompt: dict[str, Any] | None,
                      allowed_local_media_path: str | None,
                      mm_processor_kwargs: dict[str, Any] | None) -> MediaConfig:
        path = allowed_local_media_path or ""
        if path and not os.path.isdir(path):
            raise ConfigError("allowed_local_media_path", f"allowed_local_media_path "
                              f"{path!r:.200} is not a directory")
        kwargs = mm_processor_kwargs or {}
        if not isinstance(kwargs, dict):
            raise ConfigError("mm_processor_kwargs", "mm_processor_kwargs must be a JSON "
                              "object of the image processor's settings")
        return cls(max_images=image_limit(limit_mm_per_prompt),
                   allowed_local_media_path=os.path.realpath(path) if path else "",
                   fetch_timeout_s=_env_number(FETCH_TIMEOUT_ENV, DEFAULT_FETCH_TIMEOUT_S),
                   max_image_bytes=int(_env_number(MAX_BYTES_ENV, DEFAULT_MAX_IMAGE_BYTES)),
                   processor_kwargs=dict(kwargs))
