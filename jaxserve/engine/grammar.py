"""Grammars for structured outputs, with llguidance.

Why llguidance (benchmarks/README.md "Structured outputs" has the comparison): it has no
dependencies (xgrammar needs torch and triton), compiles JSON schemas, regexes, Lark and
GBNF lazily (a schema costs little until a token needs it) and fills the same bitmask
layout the sampler reads (bit b of word w = token 32 w + b).

The front door compiles (GrammarCompiler, on its own threads: grammar_worker.py) and
caches by constraint; each runner row gets a GrammarMatcher of its own, copied from the
compiled one, that fills its mask row before a step and consumes the sampled token
after it. A client's grammar is hostile until compiled within the limits below
(benchmarks/README.md "Grammar limits" has the measurements behind them).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Awaitable, Callable

import numpy as np

from jaxserve.errors import InputError
# (llguidance's own JSON parser stops at 128; the server's bodies at this one already)
from jaxserve.json_limits import MAX_JSON_DEPTH
from jaxserve.engine.grammar_worker import Cancelled, CompileWorkers, Job
from jaxserve.runner.token_constraints import static_mask
from jaxserve.structured_outputs import StructuredOutputsParams

# ---- limits ----------------------------------------------------------------------------
# A constraint's text (a schema's JSON, a grammar, a regex, the choices) at most this
# long: it bounds the depth of llguidance's native recursion, which takes at most ~810
# bytes of stack per character of the most stack-hungry grammar measured (Lark rules
# chained through 28 nested groups each; a $ref chain ~100-130; benchmarks/README.md
# "Grammar limits", benchmarks/structured/grammar_limits.py).
MAX_CONSTRAINT_CHARS = 65_536
# The compile threads' stack: 5x the ~51 MiB the worst grammar within the limit needs
# (virtual: only what a compile touches is ever resident).
COMPILE_STACK_BYTES = 256 << 20
COMPILE_THREADS = 2
# A compile (GBNF conversion, llguidance's build, its first mask) running longer fails.
COMPILE_TIMEOUT_S = 10.0
# llguidance's resource limits (LLParserLimits): no grammar or state in error texts, and
# a quarter of its default lexer fuel per mask, which the engine thread computes (a mask
# of a{1000000} took ~140 ms before failing, ~20 ms with this; realistic grammars with a
# 100k vocabulary never needed more: benchmarks/README.md "Grammar limits").
PARSER_LIMITS = dict(verbose_errors=False, initial_lexer_fuel=200_000, step_lexer_fuel=50_000)
# A constraint whose mask takes more CPU time on the compile thread (after one token)
# is refused: no fuel bounds every shape (a 60,000-character literal of one repeated
# letter cost 1.2 s per token with a 100k vocabulary), and the engine thread fills masks.
MAX_MASK_S = 0.1
# What a client or a log line sees of llguidance's error texts.
ERROR_CHARS = 200

_CACHE_SIZE = 256
_POLL_S = 0.25      # how often a waiting compile checks its deadline and its client


def short_error(text: str, limit: int = ERROR_CHARS) -> str:
    """An error text from llguidance as one bounded line: no backtrace (a caught Rust
    panic carries one), no echo past `limit` characters of the grammar it quotes."""
    text = text.split("<backtrace>", 1)[0].replace("<non-verbose/>", " ")
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _json_depth(value: Any) -> int:
    """How deep containers nest in a parsed JSON value (iteratively: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d > MAX_JSON_DEPTH:
                break
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _too_deep() -> InputError:
    return InputError(f"structured_outputs.json nests more than {MAX_JSON_DEPTH} levels "
                      f"deep (MAX_JSON_DEPTH)", "structured_outputs")


def checked_key(so: StructuredOutputsParams) -> str:
    """so.key() once so is within the size and depth limits (InputError otherwise)."""
    if so.json is not None and not isinstance(so.json, str) and \
            _json_depth(so.json) > MAX_JSON_DEPTH:
        raise _too_deep()
    try:
        key = so.key()
    except RecursionError:
        raise _too_deep() from None
    if len(key) > MAX_CONSTRAINT_CHARS:
        raise InputError(f"structured_outputs.{so.kind} is {len(key)} characters long; the "
                         f"limit is {MAX_CONSTRAINT_CHARS}", "structured_outputs")
    return key


def _grammar_text(so: StructuredOutputsParams, workers: CompileWorkers) -> str:
    """The llguidance grammar of a constraint (not yet checked). Compile thread."""
    # (llguidance loads on the first constraint: most engines never need it)
    import llguidance
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark
    if so.json is not None or so.json_object:
        schema = so.json if so.json is not None else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except RecursionError:
                raise _too_deep() from None
            except ValueError as e:
                raise InputError(f"structured_outputs.json is not valid JSON: "
                                 f"{short_error(str(e))}", "structured_outputs") from None
            if _json_depth(schema) > MAX_JSON_DEPTH:
                raise _too_deep()
        options = {"whitespace_flexible": False} if so.disable_any_whitespace else None
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise InputError(f"invalid JSON schema: {short_error(str(e))}",
                             "structured_outputs") from None
    if so.regex is not None:
        return LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        return llguidance.grammar_from("choice", list(so.choice))
    try:   # Lark as is; GBNF / EBNF (`::=` rules) converted to Lark, in Python
        with workers.interruptible():
            lark = any_to_lark(so.grammar)
    except Exception as e:   # noqa: BLE001 - the converter raises bare Exceptions
        raise InputError(f"invalid grammar: {short_error(str(e))}",
                         "structured_outputs") from None
    if len(lark) > MAX_CONSTRAINT_CHARS:
        raise InputError(f"structured_outputs.grammar is {len(lark)} characters long as "
                         f"Lark; the limit is {MAX_CONSTRAINT_CHARS}", "structured_outputs")
    return LLMatcher.grammar_from_lark(lark)


class CompiledGrammar:
    """A checked grammar and a matcher at its start, to copy for each sequence, and the
    tokens it allows first (np.uint32 words, the sampler's layout); `spec` is the
    constraint it was compiled from (what a multi-host step carries instead)."""

    def __init__(self, key: str, matcher: Any, vocab_size: int, first_mask: np.ndarray,
                 spec: StructuredOutputsParams):
        self.key = key            # the constraint's (StructuredOutputsParams.key)
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.first_mask = first_mask
        self.spec = spec

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.deep_copy(), self.vocab_size)

    def check_first_token(self, params: Any) -> None:
        """InputError when allowed_token_ids or one-token bad_words leave the grammar no
        first token (the end of the output included). Front door; a few numpy ops."""
        bad = params.bad_words_automaton
        if not params.allowed_token_ids and (bad is None or not len(bad.singles)):
            return
        row = np.empty_like(self.first_mask)
        static_mask(params, row)
        if not (row & self.first_mask).any():
            raise InputError("structured_outputs: allowed_token_ids and bad_words leave "
                             "the constraint no token to start with", "structured_outputs")


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int):
        from llguidance.numpy import allocate_token_bitmask   # (see _grammar_text)
        self._m = matcher
        self._bits = allocate_token_bitmask(1, vocab_size)   # reused every step

    def fill(self, mask_row: np.ndarray) -> None:
        """mask_row (uint32[W] of the sampler's mask) &= the tokens the grammar allows
        next; ids past the tokenizer's vocabulary are never allowed."""
        from llguidance.numpy import fill_next_token_bitmask   # (see _grammar_text)
        fill_next_token_bitmask(self._m, self._bits, 0)
        words = self._bits[0].view(np.uint32)
        n = min(len(words), len(mask_row))
        mask_row[:n] &= words[:n]
        mask_row[n:] = 0

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last num_tokens accepted (drafts looked ahead through)."""
        self._m.rollback(num_tokens)

    def accept(self, token_id: int) -> bool:
        """Advances by a sampled token; False when the grammar failed: the token was not
        allowed (its mask left nothing, say) or llguidance hit a limit. The matcher then
        stays failed; its request ends with finish_reason "error" (see `error`)."""
        return self._m.consume_token(int(token_id))

    @property
    def error(self) -> str:
        return short_error(self._m.get_error()) or "the sampled token was not allowed"


class GrammarCompiler:
    """Compiles constraints for one tokenizer on its own threads, caching by constraint
    (thread-safe: the server's requests and LLM.generate call it from any thread)."""

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
        self._workers = CompileWorkers(COMPILE_THREADS, COMPILE_STACK_BYTES)

    # ---- the callers' side -------------------------------------------------------------
    def compiled(self, so: StructuredOutputsParams, grammar: Any) -> CompiledGrammar:
        """grammar when it is so's, compiled ahead (compile_async), else so compiled."""
        if isinstance(grammar, CompiledGrammar) and grammar.key == checked_key(so):
            return grammar
        return self.compile(so)

    def compile(self, so: StructuredOutputsParams) -> CompiledGrammar:
        """Blocks the calling thread until compiled (LLM.generate)."""
        key = checked_key(so)
        hit = self._cached(key)
        if hit is not None:
            return hit
        job = self._workers.submit(self._compile, so, key)
        try:
            while True:
                try:
                    return self._finish(key, job.future.result(timeout=_POLL_S))
                except FutureTimeout:
                    self._check_deadline(job)
        finally:
            self._workers.cancel(job)     # a no-op once it finished

    async def compile_async(self, so: StructuredOutputsParams,
                            client_gone: Callable[[], Awaitable[bool]]) -> CompiledGrammar:
        """Awaits the compile (the server); a client that leaves cancels it: queued, it
        never starts; converting GBNF in Python, it stops (asyncio.CancelledError)."""
        key = checked_key(so)
        hit = self._cached(key)
        if hit is not None:
            return hit
        job = self._workers.submit(self._compile, so, key)
        waiter = asyncio.wrap_future(job.future)
        try:
            while True:
                done, _ = await asyncio.wait({waiter}, timeout=_POLL_S)
                if done:
                    return self._finish(key, waiter.result())
                self._check_deadline(job)
                if await client_gone():
                    raise asyncio.CancelledError("client disconnected")
        finally:
            self._workers.cancel(job)

    def _cached(self, key: str) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _finish(self, key: str, compiled: CompiledGrammar) -> CompiledGrammar:
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _check_deadline(self, job: Job) -> None:
        if job.running_for() > COMPILE_TIMEOUT_S:
            self._workers.cancel(job)
            raise InputError(f"structured_outputs took more than {COMPILE_TIMEOUT_S:g} s to "
                             f"compile (the limit)", "structured_outputs")

    # ---- the compile threads' side -----------------------------------------------------
    def _lltokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf   # (see _grammar_text)
                # The grammar's end is any of the model's end-of-sequence tokens.
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self._eos or None)
            return self._tokenizer

    def _compile(self, so: StructuredOutputsParams, key: str) -> CompiledGrammar:
        """Compile thread: so's matcher, its failures as InputErrors with bounded texts
        (a Rust panic is a BaseException, its text a backtrace)."""
        try:
            return self._build(so, key)
        except (InputError, Cancelled):
            raise
        except BaseException as e:    # noqa: BLE001
            raise InputError(f"invalid structured_outputs {so.kind}: "
                             f"{short_error(str(e)) or type(e).__name__}",
                             "structured_outputs") from None

    def _build(self, so: StructuredOutputsParams, key: str) -> CompiledGrammar:
        """Builds the matcher and computes its first mask (here, not on the engine
        thread: it may build much of the lexer), refusing a grammar that fails in either
        or on the first token it allows (a grammar with no end fails there), or whose
        next mask takes longer than MAX_MASK_S."""
        # (see _grammar_text: llguidance loads on the first constraint)
        from llguidance import LLMatcher, LLParserLimits
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
        tokenizer = self._lltokenizer()
        grammar = _grammar_text(so, self._workers)
        matcher = LLMatcher(tokenizer, grammar, log_level=0,
                            limits=LLParserLimits(**PARSER_LIMITS))
        if matcher.is_error():
            raise InputError(f"invalid structured_outputs {so.kind}: "
                             f"{short_error(matcher.get_error())}", "structured_outputs")
        bits = allocate_token_bitmask(1, self.vocab_size)
        fill_next_token_bitmask(matcher, bits, 0)   # builds what every copy starts from
        first = bits[0].view(np.uint32).copy()
        probe = matcher.deep_copy()
        if not matcher.is_error() and first.any():
            ids = np.flatnonzero(np.unpackbits(first.view(np.uint8), bitorder="little"))
            rest = [t for t in ids[:len(self._eos) + 1].tolist() if t not in self._eos]
            if rest:
                probe.consume_token(rest[0])
        for m in (matcher, probe):
            if m.is_error() or not first.any():
                raise InputError(f"structured_outputs {so.kind} admits no output: "
                                 f"{short_error(m.get_error()) or 'no token is allowed'}",
                                 "structured_outputs")
        # A step like any other, timed in this thread's CPU time (not the wall clock: a
        # busy machine or the GIL must not make a cheap grammar look costly).
        start = time.thread_time()
        fill_next_token_bitmask(probe, bits, 0)
        cost = time.thread_time() - start
        if cost > MAX_MASK_S:
            raise InputError(f"structured_outputs {so.kind} takes {cost * 1e3:.0f} ms per "
                             f"token to follow; the limit is {MAX_MASK_S * 1e3:.0f} ms "
                             f"(long literals or repetitions cost most)", "structured_outputs")
        return CompiledGrammar(key, matcher, self.vocab_size, first, so)
