"""Offline prompts with vLLM's names: TextPrompt and TokensPrompt, the dicts that
`LLM.generate` takes beside plain strings. Host only: no jax.

`multi_modal_data` takes {"image": a PIL image or a list of them}; the prompt then holds
one image marker per image, as the chat template writes it (Qwen3.5/3.6
`<|vision_start|><|image_pad|><|vision_end|>`, Gemma 4 `<|image|>`). A key jaxserve does
not implement (other modalities, prompt embeddings, ...) is refused by name, and so is
any key neither type has: never dropped unread.
"""
from __future__ import annotations

from typing import Any, NamedTuple, NotRequired, Sequence, TypedDict

from jaxserve.errors import InputError


class TextPrompt(TypedDict):
    """A text prompt; the engine tokenizes it. cache_salt: its prefix-cache pages are
    shared only with prompts of the same salt (vLLM's key)."""
    prompt: str
    cache_salt: NotRequired[str]
    multi_modal_data: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    """A prompt already tokenized; `prompt`, if given, is the text the ids came from
    (outputs carry it, nothing re-tokenizes it)."""
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]
    multi_modal_data: NotRequired[dict[str, Any]]


class ParsedPrompt(NamedTuple):
    prompt: str | Sequence[int]   # text or token ids
    text: str | None              # the text the ids came from, when given
    cache_salt: str | None = None
    images: tuple[Any, ...] = ()  # multi_modal_data's images, not yet checked



# vLLM's prompt keys that jaxserve knows of and does not implement, and why.
REFUSED_KEYS: dict[str, str] = {
    "mm_processor_kwargs": "per-prompt processor settings are not taken; the engine's "
                           "mm_processor_kwargs apply",
    "multi_modal_uuids": "images are keyed by their pixels' hash; uuids are not taken",
    "prompt_embeds": "prompts as embeddings are not implemented; give text or token ids",
    "token_type_ids": "token type ids (cross-encoder scoring) are not implemented",
}
_KNOWN_KEYS = ("prompt", "prompt_token_ids", "cache_salt", "multi_modal_data")


def _images(data: Any) -> tuple[Any, ...]:
    """multi_modal_data -> its images; other modalities refused by name."""
    if not isinstance(data, dict):
        raise InputError(f"multi_modal_data must be a dict such as {{'image': [...]}}, got "
                         f"{type(data).__name__}", "multi_modal_data")
    for key in data:
        if key != "image":
            raise InputError(f"multi_modal_data[{str(key)[:40]!r}] is not taken: images only "
                             f"(video and audio inputs are not served)", "multi_modal_data")
    images = data.get("image", ())
    return tuple(images) if isinstance(images, (list, tuple)) else (images,)


def parse_prompt(prompt: str | dict[str, Any]) -> ParsedPrompt:
    """A str, TextPrompt or TokensPrompt -> its parts (the input processor checks the
    salt). Raises InputError naming the key it cannot take."""
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None)
    if not isinstance(prompt, dict):
        raise InputError(f"a prompt must be a str, a TextPrompt or a TokensPrompt, got "
                         f"{type(prompt).__name__}", "prompt")
    for key in prompt:
        if key in REFUSED_KEYS:
            raise InputError(f"prompt key {key!r} is not supported by jaxserve: "
                             f"{REFUSED_KEYS[key]}", key if isinstance(key, str) else "prompt")
        if key not in _KNOWN_KEYS:
            raise InputError(f"prompt key {key!r} is not one jaxserve knows (TextPrompt: "
                             f"'prompt'; TokensPrompt: 'prompt_token_ids' and optionally "
                             f"'prompt'; both: 'cache_salt')", "prompt")
    text = prompt.get("prompt")
    salt = prompt.get("cache_salt")
    images = _images(prompt["multi_modal_data"]) if "multi_modal_data" in prompt else ()
    if text is not None and not isinstance(text, str):
        raise InputError(f"'prompt' must be a str, got {type(text).__name__}", "prompt")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        # Token ids are never text to tokenize: a str is refused as ids are.
        return ParsedPrompt([ids] if isinstance(ids, str) else ids, text, salt, images)
    if text is not None:
        return ParsedPrompt(text, None, salt, images)
    raise InputError("a prompt dict needs 'prompt' (TextPrompt) or 'prompt_token_ids' "
                     "(TokensPrompt)", "prompt")
