"""Image parts out of chat messages: each `image_url` part becomes a bare `{"type":
"image"}` part (what Qwen3.5/3.6's and Gemma 4's chat templates turn into their image
marker) and its URL is collected, in the conversation's order. Part types jaxserve does not
take are refused by name."""
from __future__ import annotations

from typing import Any

from jaxserve.errors import InputError

# The part the chat templates read as "an image here"; only this module writes it.
IMAGE_PART = {"type": "image"}
# Part types refused, and why (vLLM's names and the OpenAI API's).
REFUSED_PARTS = {
    "image_pil": "an in-memory PIL image part is not taken; send an image_url (a data URL)",
    "image_embeds": "precomputed image embeddings are not taken; send the image",
    "input_image": "the Responses API's part; jaxserve serves chat completions: use image_url",
    "video_url": "video inputs are not served",
    "video": "video inputs are not served",
    "input_audio": "audio inputs are not served",
    "audio_url": "audio inputs are not served",
    "audio": "audio inputs are not served",
    "file": "file parts are not served",
    "image": "send an image as an image_url part",
}


def _image_url(part: dict, field: str) -> str:
    spec = part.get("image_url")
    if isinstance(spec, dict):
        extra = set(spec) - {"url", "detail"}
        if extra:
            raise InputError(f"image_url takes 'url' (and 'detail'), not "
                             f"{sorted(extra)[0]!r:.40}", field)
        if spec.get("detail", "auto") not in ("auto", None):
            raise InputError("image_url.detail: only 'auto' (the processor's own size "
                             "rules; --mm-processor-kwargs sets them)", field)
        spec = spec.get("url")
    if not isinstance(spec, str) or not spec:
        raise InputError("an image_url part needs image_url.url, a non-empty string", field)
    return spec


def split_images(messages: list[Any], field: str = "messages") -> tuple[list[Any], list[str]]:
    """The messages with image_url parts replaced by IMAGE_PART, and the images' URLs;
    messages without image parts come back as they are."""
    out, urls = [], []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                urls.append(_image_url(part, field))
                parts.append(dict(IMAGE_PART))
            elif isinstance(kind, str) and kind in REFUSED_PARTS:
                raise InputError(f"content part type {kind!r}: {REFUSED_PARTS[kind]}", field)
            else:
                parts.append(part)
        out.append({**m, "content": parts})
    return out, urls
