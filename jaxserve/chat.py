"""Chat messages -> prompt token ids through the tokenizer's chat template."""
from __future__ import annotations

from typing import Any


def message_text(content: Any) -> str:
    """OpenAI message content: a string, or a list of parts of which text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError("only text content parts are supported")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ValueError(f"message content must be a string or a list of parts, got "
                     f"{type(content).__name__}")


def render_chat(tokenizer, messages: list[dict], *, chat_template: str | None = None,
                add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this model has none")
    if not messages:
        raise ValueError("messages must not be empty")
    conv = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError("each message needs a 'role'")
        conv.append({"role": m["role"], "content": message_text(m.get("content"))})
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; pass one (--chat-template)")
    ids = tokenizer.apply_chat_template(conv, chat_template=chat_template,
                                        add_generation_prompt=add_generation_prompt,
                                        tokenize=True, return_dict=False, **template_kwargs)
    return list(ids)
