"""Chat messages -> prompt token ids through the tokenizer's chat template.

Everything that goes wrong here is the request's fault (its messages, its
template arguments, or a template that refuses them), so every failure is an
InputError (a ValueError) naming the field at fault, with a message for the client.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from jaxserve import json_limits
from jaxserve.errors import InputError

if TYPE_CHECKING:   # for hints only: transformers is heavy and loaded late
    from transformers import PreTrainedTokenizerBase


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
                kind = part.get("type") if isinstance(part, dict) else None
                raise InputError(f"content part type {str(kind)[:40]!r} is not supported "
                                 f"here (text, and image_url where the model takes images)",
                                 "messages")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise InputError(f"message content must be a string or a list of parts, got "
                     f"{type(content).__name__}", "messages")


# Variables the renderer itself hands every template (transformers' render_jinja_template).
_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def _renderer_arguments(tokenizer) -> set[str]:
    """apply_chat_template's own parameters and the template variables it sets:
    template kwargs may not override them."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return {p.name for p in params
            if p.kind is not inspect.Parameter.VAR_KEYWORD} | _TEMPLATE_VARIABLES


# Message fields besides role and content that templates read (tool calling, names,
# earlier turns' reasoning).
_PASSED_FIELDS = ("tool_calls", "tool_call_id", "name", "reasoning_content")


def _tool_call_for_template(call: Any) -> Any:
    """An OpenAI tool call with its arguments as an object when they are JSON text:
    templates iterate them (Qwen3.5's `arguments|items`) or dump them (`tojson`)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        try:   # (bounded depth: a 100k-deep text would overflow the parser's recursion)
            args = json_limits.loads(fn["arguments"])
        except ValueError as e:
            raise InputError(f"tool call arguments are not valid JSON ({e}): "
                             f"{fn['arguments'][:80]!r}", "messages") from None
        if isinstance(args, dict):
            fn["arguments"] = args
    return {**call, "function": fn}


def _template_content(content: Any) -> Any:
    """Text, or (for a message with images) its parts as the templates read them: text
    parts and bare {"type": "image"} markers (jaxserve/multimodal/chat_parts.py)."""
    if isinstance(content, list) and {"type": "image"} in content:
        return [p if p == {"type": "image"} else {"type": "text", "text": message_text([p])}
                for p in content]
    return message_text(content)


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(p.get("text", "")) for p in content)


def _template_message(m: dict) -> dict:
    out = {"role": m["role"], "content": _template_content(m.get("content"))}
    for name in _PASSED_FIELDS:
        if m.get(name) is not None:
            out[name] = m[name]
    if isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [_tool_call_for_template(c) for c in out["tool_calls"]]
    return out


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict], *,
                chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                max_chars: int | None = None,
                template_kwargs: dict[str, Any] | None = None,
                tools: list[dict] | None = None,
                add_special_tokens: bool = False) -> list[int]:
    """continue_final_message: the prompt ends inside the last message (no end-of-turn
    after it), so the model goes on with it, e.g. an assistant answer begun by the
    client; not with add_generation_prompt.
    max_chars: refuse conversations whose text is longer, before rendering.
    template_kwargs: extra template variables (a client's chat_template_kwargs).
    tools: the request's OpenAI tool definitions, for templates that describe them.
    add_special_tokens: the tokenizer's own special tokens (BOS) on top of those the
    template writes (vLLM's chat field; off, as there: templates write their own)."""
    template_kwargs = template_kwargs or {}
    if tokenizer is None:
        raise InputError("chat needs a tokenizer; this model has none", "messages")
    if not messages:
        raise InputError("messages must not be empty", "messages")
    if continue_final_message and add_generation_prompt:
        raise InputError("continue_final_message goes on with the last message; it cannot "
                         "be combined with add_generation_prompt (set that to false)",
                         "continue_final_message")
    conv = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InputError("each message needs a string 'role'", "messages")
        conv.append(_template_message(m))
    chars = sum(len(m["role"]) + _content_chars(m["content"]) for m in conv)
    if max_chars is not None and chars > max_chars:
        raise InputError(f"messages have {chars} characters, more than the {max_chars} "
                         f"that max_model_len tokens can hold", "messages")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise InputError("the tokenizer has no chat template; pass one (--chat-template)",
                         "messages")
    clash = sorted(set(template_kwargs) & _renderer_arguments(tokenizer))
    if clash:
        raise InputError(f"chat_template_kwargs may not set {', '.join(clash)}: the server "
                         f"sets {'it' if len(clash) == 1 else 'them'} itself",
                         "chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(conv, chat_template=chat_template, tools=tools,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             tokenize=False, **template_kwargs)
    except Exception as e:  # noqa: BLE001 - the template runs on the request's data
        raise InputError(f"the chat template failed on these messages: "
                         f"{type(e).__name__}: {e}", "messages") from None
    # (what apply_chat_template's own tokenize=True does, with add_special_tokens=False)
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
