"""GET /tokenizer_info: the tokenizer's configuration, in the shape vLLM returns it.

vLLM answers the tokenizer's init kwargs (its tokenizer_config.json, as loaded) without
the paths of its files, special tokens as their text, plus `tokenizer_class` and the
server's chat template. jaxserve adds what a client otherwise has to find out by trying:
the special tokens the tokenizer resolved, its vocabulary size and max_model_len.
"""
from __future__ import annotations

import math
from typing import Any


def tokenizer_info(tokenizer: Any, *, chat_template: str | None, max_model_len: int) -> dict:
    """tokenizer: a Hugging Face tokenizer; chat_template: the server's --chat-template
    (it wins over the tokenizer's own, as it does when chats are rendered)."""
    kwargs = getattr(tokenizer, "init_kwargs", None) or {}
    # File paths say where the server keeps its files and nothing about the tokenizer.
    info = {k: _jsonable(v) for k, v in kwargs.items() if not k.endswith("_file")}
    for name, token in getattr(tokenizer, "special_tokens_map", {}).items():
        info.setdefault(name, _jsonable(token))
    info["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    info["vocab_size"] = len(tokenizer)          # added tokens included
    info["max_model_len"] = max_model_len
    return info


def _jsonable(value: Any) -> Any:
    """A JSON value: special tokens (AddedToken) as their text, tuples as lists, keys as
    strings; anything else unknown as its str (an answer must never fail to encode)."""
    if hasattr(value, "content"):       # tokenizers.AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
