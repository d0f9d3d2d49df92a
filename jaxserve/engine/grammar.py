"""Grammars for structured outputs, with llguidance.

Why llguidance (benchmarks/README.md "Structured outputs" has the comparison): it has no
dependencies (xgrammar needs torch and triton), compiles JSON schemas, regexes, Lark and
GBNF lazily (a schema costs little until a token needs it) and fills the same bitmask
layout the sampler reads (bit b of word w = token 32 w + b).

The front door compiles (GrammarCompiler.compile, in the input processor's worker
thread, never on the engine loop) and caches by constraint; each runner row gets a
GrammarMatcher of its own, copied from the compiled one, that fills its mask row before
a step and consumes the sampled token after it.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from jaxserve.engine.errors import InputError
from jaxserve.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("jaxserve")

_CACHE_SIZE = 256


def _grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked)."""
    import llguidance
    from llguidance import LLMatcher
    if so.json is not None or so.json_object:
        schema = so.json if so.json is not None else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InputError(f"structured_outputs.json is not valid JSON: {e}",
                                 "structured_outputs") from None
        options = {"whitespace_flexible": False} if so.disable_any_whitespace else None
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise InputError(f"invalid JSON schema: {e}", "structured_outputs") from None
    if so.regex is not None:
        return LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        return llguidance.grammar_from("choice", list(so.choice))
    try:   # Lark as is; GBNF / EBNF (`::=` rules) converted to Lark
        return llguidance.grammar_from("grammar", so.grammar)
    except ValueError as e:
        raise InputError(f"invalid grammar: {e}", "structured_outputs") from None


class CompiledGrammar:
    """A checked grammar and a matcher at its start, to copy for each sequence; `spec`
    is the constraint it was compiled from (what a multi-host step carries instead)."""

    def __init__(self, matcher: Any, vocab_size: int, spec: StructuredOutputsParams):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.spec = spec

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.deep_copy(), self.vocab_size)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int):
        from llguidance.numpy import allocate_token_bitmask
        self._m = matcher
        self._bits = allocate_token_bitmask(1, vocab_size)   # reused every step

    def fill(self, mask_row: np.ndarray) -> None:
        """mask_row (uint32[W] of the sampler's mask) &= the tokens the grammar allows
        next; ids past the tokenizer's vocabulary are never allowed."""
        from llguidance.numpy import fill_next_token_bitmask
        fill_next_token_bitmask(self._m, self._bits, 0)
        words = self._bits[0].view(np.uint32)
        n = min(len(words), len(mask_row))
        mask_row[:n] &= words[:n]
        mask_row[n:] = 0

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last num_tokens accepted (drafts looked ahead through)."""
        self._m.rollback(num_tokens)

    def accept(self, token_id: int) -> None:
        """Advances by a sampled token. One the grammar does not allow (it cannot be
        sampled, so only a bug gets here) leaves the matcher in error, allowing only the
        end from then on; logged."""
        if not self._m.consume_token(int(token_id)):
            logger.warning("structured output: token %d was not allowed by its grammar: %s",
                           token_id, self._m.get_error())


class GrammarCompiler:
    """Compiles constraints for one tokenizer, caching by constraint (thread-safe: the
    server's input processing runs in worker threads)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int,
                 eos_token_ids: tuple[int, ...] = ()):
        self._hf = hf_tokenizer
        # llguidance needs every id the tokenizer has; ids past the model's vocabulary
        # (added tokens of some checkpoints) are cut from the mask rows (never sampled).
        self.vocab_size = max(vocab_size, len(hf_tokenizer))
        self._eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self._tokenizer = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()

    def _lltokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                # The grammar's end is any of the model's end-of-sequence tokens.
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos or None)
            return self._tokenizer

    def compile(self, so: StructuredOutputsParams) -> CompiledGrammar:
        key = so.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        from llguidance import LLMatcher
        tokenizer = self._lltokenizer()
        grammar = _grammar_text(so)
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InputError(f"invalid structured_outputs {so.kind}: {matcher.get_error()}",
                             "structured_outputs")
        compiled = CompiledGrammar(matcher, self.vocab_size, so)
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled
