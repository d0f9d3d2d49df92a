"""Incremental detokenization and stop-string detection for one completion.

Host-only, no jax. The tokenizer is passed in (a transformers tokenizer; a fast one
is decoded through its Rust backend directly to skip Python overhead).

How it stays cheap: the text is built from a small sliding window of token ids.
``prefix_offset..read_offset`` are tokens whose text was already emitted; the
window is decoded twice per emitting step (prefix alone, prefix + new tokens) and
the difference is the new text. Decoding with a little left context keeps
tokenizers that strip a leading space at the start of a string (SentencePiece)
correct, and the window start is always a character boundary, so for byte-level
BPE the concatenated deltas equal a full decode of the output ids. Text ending
in U+FFFD (an incomplete UTF-8 sequence so far) is held back until a later token
completes it, or until `finalize()`.

Lazy mode (``incremental=False``): for requests that neither stream nor have
stop strings, `update` only records ids and `finalize()` decodes them in one go
(the same window algorithm over everything, so the text is identical). Stop
strings force incremental mode, since they must be detected as tokens arrive.

Why not `tokenizers.decoders.DecodeStream` (the same window algorithm in Rust;
benchmarks/step/detokenizer.py, README "Incremental detokenization"): the decoding is not
where a token's time goes. DecodeStream alone is 2-3x faster per token than this
class, but with what the engine needs on top (stop strings, lazy mode, the held-back
tail that DecodeStream never flushes) it is 1.1x faster when streaming and 0.7x in
lazy mode; it needs a fast tokenizer (this class also serves slow ones), and it
raises where a kept special token splits a character's byte-fallback tokens (a model
can sample that), where this class goes on.
"""

from __future__ import annotations

from typing import Any, Sequence

# Prompt tokens kept as left context for the first decode window.
_CONTEXT_TOKENS = 5
# Pending tokens after which a trailing U+FFFD is taken as final (no UTF-8
# character needs more than 4 bytes, every byte-level token carries >= 1).
_MAX_PENDING_TOKENS = 8
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns the output ids of one completion into text, step by step.

    Attributes: ``token_ids`` (output ids so far), ``output_text`` (text so far,
    truncated at a stop string), ``stop_reason`` (the matched stop string or None).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] | None,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        incremental: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.incremental = incremental or bool(self.stop)
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        # While streaming, hold back text that may still turn out to start a stop
        # string (it would be cut from the output later).
        self._stop_buffer = (
            self.max_stop_len - 1 if self.stop and not include_stop_str_in_output else 0
        )

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # fast tokenizer: call the Rust decoder directly
            self._decode_fn = lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
        else:
            self._decode_fn = lambda ids, skip: tokenizer.decode(
                ids,
                skip_special_tokens=skip,
                spaces_between_special_tokens=spaces_between_special_tokens,
                clean_up_tokenization_spaces=False,
            )

        self.token_ids: list[int] = []
        self.output_text = ""
        self.stop_reason: str | None = None
        self._finalized = False
        self._sent_offset = 0  # chars of output_text already handed out as deltas
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._window: list[int] = context  # context ids followed by output ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # decode of window[prefix:read], lazily

    # --- public API ---

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append new output ids; returns the stop string if one now ends the text.

        After a stop string was found, further ids are recorded but add no text.
        """
        if not new_token_ids:
            return None
        self.token_ids.extend(new_token_ids)
        if self.stop_reason is not None:
            return None
        self._window.extend(new_token_ids)
        if not self.incremental:
            return None
        return self._advance(final=False)

    def finalize(self) -> str:
        """Decode what is still pending (lazy mode, held-back text); returns output_text."""
        if not self._finalized and self.stop_reason is None:
            self._advance(final=True)
        self._finalized = True
        return self.output_text

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to stream: the new part (delta) or all so far, minus a stop-string buffer
        while unfinished."""
        end = len(self.output_text) if finished else len(self.output_text) - self._stop_buffer
        end = max(end, 0)
        if not delta:
            return self.output_text[:end]
        start = self._sent_offset
        if end <= start:
            return ""
        self._sent_offset = end
        return self.output_text[start:end]

    def decode_token(self, token_id: int) -> str:
        """Text of a single token (for Logprob.decoded_token); may be U+FFFD."""
        return self._decode_fn([token_id], False)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    # --- internals ---

    def _advance(self, final: bool) -> str | None:
        """Decode the window; emit new text unless it ends mid-character."""
        if self._read_offset >= len(self._window):
            return None
        if self._prefix_text is None:
            self._prefix_text = self._decode_fn(
                self._window[self._prefix_offset : self._read_offset], self.skip_special_tokens
            )
        prefix_text = self._prefix_text
        full_text = self._decode_fn(self._window[self._prefix_offset :], self.skip_special_tokens)
        pending = len(self._window) - self._read_offset
        if len(full_text) <= len(prefix_text):
            return None  # e.g. only skipped special tokens so far
        if (
            full_text.endswith(_REPLACEMENT)
            and not final
            and pending < _MAX_PENDING_TOKENS
        ):
            return None  # wait for the rest of the character
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._window)
        self._prefix_text = None
        self.output_text += new_text
        return self._check_stop(len(new_text))

    def _check_stop(self, num_new_chars: int) -> str | None:
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        text = self.output_text
        # A stop string that ends in the new text starts at most max_stop_len - 1
        # characters before it.
        start = max(len(text) - num_new_chars - self.max_stop_len + 1, 0)
        best_pos, best = -1, None
        for s in self.stop:
            pos = text.find(s, start)
            if pos != -1 and (best is None or pos < best_pos):
                best_pos, best = pos, s
        if best is None:
            return None
        end = best_pos + len(best) if self.include_stop_str_in_output else best_pos
        self.output_text = text[:end]
        self._sent_offset = min(self._sent_offset, end)
        self.stop_reason = best
        return best
