"""Request fields jaxserve knows of but does not implement: refused by name, never
silently dropped.

A field in REFUSED with a value that would change the answer is a 400 naming it; the
same field with a value that changes nothing (an empty tool list, `response_format`
of type "text", `logit_bias: {}`) is accepted. A field in IGNORED is one vLLM also
accepts without effect on generation (bookkeeping for the OpenAI platform); any other
unknown field is ignored as OpenAI-compatible servers do. Both are logged, in one
bounded line per request and once per field name, so an operator can see what
clients send.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from jaxserve.api.errors import clip

logger = logging.getLogger("jaxserve")


def _absent(v: Any) -> bool:
    return v is None


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {} or v == ""


def _false(v: Any) -> bool:
    return v is None or v is False


def _text_format(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and v.get("type") == "text")


_TOOLS = "tools are for /v1/chat/completions"
_LEGACY = "the deprecated functions API is not implemented; use tools and tool_choice"

# field: (value that changes nothing, why it is refused otherwise)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "guided_whitespace_pattern": (_absent, "a whitespace pattern is not implemented (no "
                                           "whitespace: structured_outputs."
                                           "disable_any_whitespace)"),
    "tools": (_empty, _TOOLS),
    "tool_choice": (lambda v: v is None or v in ("none", "auto"), _TOOLS),
    "functions": (_empty, _LEGACY),
    "function_call": (lambda v: v is None or v == "none", _LEGACY),
    "prompt_logprobs": (_absent, "not served by the HTTP API yet (offline "
                                 "SamplingParams(prompt_logprobs=...) has it; on "
                                 "/v1/completions use echo with logprobs)"),
    "best_of": (lambda v: v is None or v == 1, "only 1: jaxserve does not rank candidates"),
    "use_beam_search": (_false, "beam search is not implemented"),
    "length_penalty": (lambda v: v is None or v == 1, "beam search is not implemented"),
    "suffix": (_empty, "insertion (a suffix after the completion) is not implemented"),
    "return_tokens_as_token_ids": (_false, "not implemented"),
    "chat_template": (_absent, "a per-request template is not implemented; the server's "
                               "--chat-template applies"),
    "continue_final_message": (_false, "it is for chat messages (/v1/chat/completions, "
                                       "/tokenize)"),
    "documents": (_empty, "not implemented"),
    "mm_processor_kwargs": (_empty, "per-request image processor settings are not taken; "
                                    "the server's --mm-processor-kwargs apply"),
    "audio": (_absent, "jaxserve answers in text only"),
    "modalities": (lambda v: v is None or v == ["text"], "jaxserve answers in text only"),
    "prediction": (_absent, "predicted outputs are not implemented"),
    "reasoning_effort": (_absent, "not implemented (for Qwen3 use chat_template_kwargs "
                                  "{'enable_thinking': ...})"),
    "web_search_options": (_absent, "not implemented"),
}
# Accepted without effect, as vLLM does: the OpenAI platform's bookkeeping.
IGNORED = frozenset({"store", "metadata", "service_tier", "request_id"})
# A chat message's own fields beyond those the template gets (api/protocol.ChatMessage).
MESSAGE_REFUSED = {"function_call": (_absent, _LEGACY)}
# Nested: stream_options' own fields.
STREAM_REFUSED = {"continuous_usage_stats": (_false, "usage in every chunk is not "
                                                     "implemented; include_usage is")}


def _first_refused(data: dict, known: set[str], refused: dict, ignored: frozenset,
                   what: str, unused: list[str]) -> tuple[str, str] | None:
    """The first refused field; appends the ignored ones to `unused` (as the log says
    them)."""
    for name, value in data.items():
        if name in known:
            continue
        if name in refused:
            is_noop, why = refused[name]
            if not is_noop(value):
                return name, f"{name} is not supported by jaxserve: {why}"
        else:
            kind = "no effect" if name in ignored else "unknown"
            unused.append(f"{what} {clip(repr(name), _MAX_NAME_CHARS)} ({kind})")
    return None


_MESSAGE_FIELDS = {"role", "content", "tool_calls", "tool_call_id", "name",
                   "reasoning_content"}
# A request's ignored fields make one log line naming at most this many; each name is
# logged once, and at most _MAX_REMEMBERED are remembered (a client sending ever new
# names must not grow the server's memory).
_MAX_LOGGED_NAMES = 10
_MAX_NAME_CHARS = 64
_MAX_REMEMBERED = 1024
_logged: set[str] = set()
_lock = threading.Lock()


def _log_unused(unused: list[str]) -> None:
    """One line for a request's ignored fields, those not logged before."""
    with _lock:
        new = [u for u in dict.fromkeys(unused) if u not in _logged]
        _logged.update(new[:max(_MAX_REMEMBERED - len(_logged), 0)])
    if new:
        more = f" and {len(new) - _MAX_LOGGED_NAMES} more" if len(new) > _MAX_LOGGED_NAMES \
            else ""
        logger.warning("ignored, as jaxserve does not implement them: %s%s",
                       ", ".join(new[:_MAX_LOGGED_NAMES]), more)


def refused_field(data: Any, known: set[str]) -> tuple[str, str] | None:
    """(field, message) for the first field of the raw body that asks for something
    jaxserve does not do, else None; logs the fields it ignores (each name once)."""
    if not isinstance(data, dict):
        return None
    unused: list[str] = []
    try:
        return _refused(data, known, unused)
    finally:
        _log_unused(unused)


def _refused(data: dict, known: set[str], unused: list[str]) -> tuple[str, str] | None:
    refused = _first_refused(data, known, REFUSED, IGNORED, "request field", unused)
    if refused:
        return refused
    messages = data.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        if isinstance(message, dict):
            refused = _first_refused(message, _MESSAGE_FIELDS, MESSAGE_REFUSED,
                                     frozenset(), "chat message field", unused)
            if refused:
                return f"messages.{i}.{refused[0]}", f"messages[{i}]: {refused[1]}"
    stream_options = data.get("stream_options")
    if isinstance(stream_options, dict):
        for name, (is_noop, why) in STREAM_REFUSED.items():
            if not is_noop(stream_options.get(name)):
                return f"stream_options.{name}", f"stream_options.{name}: {why}"
    return None
