"""Images to encoder inputs and prompt placeholders, without torchvision.

transformers 5 gives each of these models two image processors: a torchvision one (the
default when torchvision imports) and a PIL/numpy one (`backend="pil"`: Qwen2VLImageProcessorPil,
Gemma4ImageProcessorPil). The full processors (Qwen3VLProcessor, Gemma4Processor) cannot be
built without torchvision (their video processors need it), so jaxserve loads the image
processor alone with the PIL backend and expands the placeholders itself, as the full
processor's replace_image_token does. docs/VISION.md compares the two backends.

The chat template writes one marker per image: Qwen3.5/3.6
`<|vision_start|><|image_pad|><|vision_end|>`, Gemma 4 `<|image|>`. Expansion turns the
single image token into the image's tokens: Qwen `<|image_pad|>` x (t*h*w / merge^2),
Gemma 4 `<|image>` + `<|image|>` x num_soft_tokens + `<image|>`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

QWEN, GEMMA4 = "qwen3_5", "gemma4"
_FAMILIES = {"qwen3_5": QWEN, "qwen3_5_moe": QWEN, "gemma4": GEMMA4}


def vision_family(config: dict[str, Any]) -> str:
    """Which tower a config.json's model carries ("qwen3_5" or "gemma4")."""
    family = _FAMILIES.get(config.get("model_type", ""))
    if family is None or not config.get("vision_config"):
        raise ValueError(f"model_type {config.get('model_type')!r} has no vision tower jaxserve serves")
    return family


@dataclass(frozen=True)
class ImageTokens:
    """The token ids that carry an image in a prompt. `start`/`end` are set where the
    expansion itself writes them around the image tokens (Gemma 4); Qwen's template
    writes its <|vision_start|>/<|vision_end|> around the single marker."""
    image: int
    start: int | None = None
    end: int | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ImageTokens:
        if vision_family(config) == GEMMA4:
            return cls(image=config["image_token_id"], start=config["boi_token_id"], end=config["eoi_token_id"])
        return cls(image=config["image_token_id"])


@dataclass(frozen=True)
class ProcessedImage:
    """One image, ready for its tower. Qwen: pixels [patches, C*T*P*P] and grid (t, h, w)
    in patches; Gemma 4: pixels [max_patches, 3*P*P] padded, position_ids [max_patches, 2]
    ((column, row), (-1, -1) for padding)."""
    pixels: np.ndarray
    num_tokens: int
    grid: tuple[int, int, int] | None = None
    position_ids: np.ndarray | None = None


def load_image_processor(model_dir: str | Path, **mm_processor_kwargs: Any) -> Any:
    """The checkpoint's image processor (preprocessor_config.json), PIL backend, with
    `mm_processor_kwargs` (e.g. max_pixels, max_soft_tokens) overriding its settings."""
    from transformers import AutoImageProcessor
    return AutoImageProcessor.from_pretrained(str(model_dir), backend="pil", **mm_processor_kwargs)


def preprocess(processor: Any, family: str, images: Sequence[Any]) -> list[ProcessedImage]:
    """Each PIL image through the processor, split per image."""
    if not images:
        return []
    out = processor(images=list(images), return_tensors="np")
    if family == GEMMA4:
        pixels, positions = out["pixel_values"], out["image_position_ids"]
        counts = [int(n) for n in out["num_soft_tokens_per_image"]]
        return [ProcessedImage(pixels[i], counts[i], position_ids=positions[i]) for i in range(len(images))]
    merge = processor.merge_size ** 2
    result, start = [], 0
    for t, h, w in out["image_grid_thw"].tolist():
        n = t * h * w
        result.append(ProcessedImage(out["pixel_values"][start:start + n], n // merge, grid=(t, h, w)))
        start += n
    return result


def expand_image_tokens(token_ids: Sequence[int], images: Sequence[ProcessedImage],
                        tokens: ImageTokens) -> list[int]:
    """The prompt with its k-th image token replaced by the k-th image's tokens."""
    out: list[int] = []
    k = 0
    for t in token_ids:
        if t != tokens.image:
            out.append(t)
            continue
        if k == len(images):
            raise ValueError(f"the prompt has more image placeholders than the {len(images)} image(s) given")
        out.extend(([] if tokens.start is None else [tokens.start]) + [tokens.image] * images[k].num_tokens
                   + ([] if tokens.end is None else [tokens.end]))
        k += 1
    if k != len(images):
        raise ValueError(f"{len(images)} image(s) given but the prompt has {k} image placeholder(s)")
    return out
