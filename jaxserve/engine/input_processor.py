"""The front door: every request, from the server or from `LLM`, is checked here once.

It owns the limits that depend on the served model (vocabulary, max_model_len,
the longest text worth tokenizing); SamplingParams owns the static ones (n, the
int32 and int64 ranges, finite floats). Past this point the engine trusts its
inputs: a value that would overflow a device array or exhaust memory never
gets in. Host only: no jax.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from jaxserve.engine.chat_template import render_chat
from jaxserve.sampling_params import MAX_BANNED_TOKENS, SamplingParams

# Normalisers (NFC, for one) may merge a few characters into one before the tokenizer
# splits the text, so the character bound allows this factor on top of the longest token.
_NORMALISER_SLACK = 4


class InputError(ValueError):
    """A request the engine refuses; `param` names the field at fault (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def check_unicode(text: str, field: str) -> None:
    """Lone surrogates (which JSON's \\ud800 escapes can carry) are not text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{field} is not valid Unicode: {e.reason} at position {e.start}",
                         field) from None


class InputProcessor:
    def __init__(self, *, tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # A text longer than this cannot fit in max_model_len tokens (no token covers
        # more characters than the longest vocabulary entry), so it is refused before
        # the tokenizer spends time on it.
        longest = max(map(len, tokenizer.get_vocab()), default=1) if tokenizer else 1
        self.max_prompt_chars = max_model_len * max(longest, 1) * _NORMALISER_SLACK

    # ---- text -> token ids -----------------------------------------------------------
    def check_text(self, text: str, field: str = "prompt") -> None:
        if not isinstance(text, str):
            raise InputError(f"{field} must be a string, got {type(text).__name__}", field)
        if not text:
            raise InputError(f"{field} must not be empty", field)
        if len(text) > self.max_prompt_chars:
            raise InputError(
                f"{field} has {len(text)} characters: more than max_model_len="
                f"{self.max_model_len} tokens can hold with this tokenizer (at most "
                f"{self.max_prompt_chars} characters)", field)
        check_unicode(text, field)

    def tokenize(self, text: str, *, add_special_tokens: bool = True,
                 field: str = "prompt") -> list[int]:
        self.check_text(text, field)
        if self.tokenizer is None:
            raise InputError("this model has no tokenizer: send token ids", field)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def render_chat(self, messages: list[dict], *, chat_template: str | None = None,
                    add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Chat messages -> prompt ids; every failure is the request's (InputError)."""
        _check_strings(messages, "messages")
        _check_strings(template_kwargs, "chat_template_kwargs")
        try:
            return render_chat(self.tokenizer, messages, chat_template=chat_template,
                               add_generation_prompt=add_generation_prompt,
                               max_chars=self.max_prompt_chars,
                               template_kwargs=template_kwargs)
        except ValueError as e:
            param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
            raise InputError(str(e), param) from None

    # ---- token ids + sampling parameters --------------------------------------------
    def process(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Checks one request; returns its params with max_tokens resolved."""
        if not isinstance(prompt_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids):
            raise InputError("prompt_token_ids must be a list of ints", "prompt")
        n = len(prompt_token_ids)
        if n == 0:
            raise InputError("the prompt is empty", "prompt")
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                             "prompt")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise InputError(f"stop_token_ids: {bad[0]} is outside the vocabulary "
                             f"[0, {vocab})", "stop_token_ids")
        if n >= self.max_model_len:
            raise InputError(f"the prompt has {n} tokens; max_model_len={self.max_model_len} "
                             f"leaves no room to generate (prompt must be < max_model_len)",
                             "prompt")
        if params.min_tokens and len(params.stop_token_ids) + 1 > MAX_BANNED_TOKENS:
            raise InputError(f"stop_token_ids: at most {MAX_BANNED_TOKENS - 1} with "
                             f"min_tokens > 0, got {len(params.stop_token_ids)}",
                             "stop_token_ids")
        room = self.max_model_len - n
        if params.max_tokens is None:
            return replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        if params.max_tokens > room:
            raise InputError(f"max_tokens={params.max_tokens} cannot fit: the prompt has {n} "
                             f"tokens and max_model_len={self.max_model_len} leaves {room}",
                             "max_tokens")
        return params


def _check_strings(value: Any, field: str) -> None:
    """check_unicode on every string inside nested dicts and lists."""
    if isinstance(value, str):
        check_unicode(value, field)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, field)
            _check_strings(v, field)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_strings(v, field)
