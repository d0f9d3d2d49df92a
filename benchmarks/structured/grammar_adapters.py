"""One interface over each grammar library (llguidance, xgrammar), so that the timing
drives and the feature probes run the same code against both."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from importlib import metadata
from typing import Any

import numpy as np

from benchmarks.structured.grammar_fixtures import Grammar


class CompileError(Exception):
    """The backend rejected a grammar; the message is the library's own."""


class Backend:
    """A library bound to the tokenizer; `tokenizer_setup_s` is what binding it took."""
    name = ""
    package = ""

    def __init__(self, hf_tokenizer: Any, threads: int):
        self.hf = hf_tokenizer
        self.threads = threads
        self.vocab_size = len(hf_tokenizer)
        self.eos = hf_tokenizer.eos_token_id
        t0 = time.perf_counter()
        self._setup()
        self.tokenizer_setup_s = time.perf_counter() - t0

    def _setup(self) -> None:
        raise NotImplementedError

    def set_batch_threads(self, threads: int) -> None:
        """Threads of the batched mask and consume calls."""
        raise NotImplementedError

    # compile
    def compile_cold(self, g: Grammar) -> tuple[Any, Any]:
        """(matcher, what a server keeps for the next request of this grammar)."""
        raise NotImplementedError

    def compile_again(self, g: Grammar) -> Any:
        """A matcher for a grammar already compiled, through the library's own cache
        (or none): the path of a server that keys nothing itself."""
        raise NotImplementedError

    def from_kept(self, kept: Any) -> Any:
        raise NotImplementedError

    # masks
    def new_bitmask(self, rows: int) -> Any:
        raise NotImplementedError

    @staticmethod
    def bits(bitmask: Any) -> np.ndarray:
        return np.asarray(bitmask)

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        raise NotImplementedError

    def consume(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError

    def fill_batch(self, matchers: list[Any], bitmask: Any) -> None:
        raise NotImplementedError

    def consume_batch(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        raise NotImplementedError

    def rollback(self, matcher: Any, n: int) -> None:
        matcher.rollback(n)   # the same call in both libraries

    def is_done(self, matcher: Any) -> bool:
        raise NotImplementedError

    # features
    def structural_tag(self, trigger: str, begin: str, schema: dict, end: str) -> Any:
        """A matcher of free text in which `trigger` opens a `begin` JSON(schema) `end`
        tool call."""
        return self.compile_cold(self.structural_tag_grammar(trigger, begin, schema, end))[0]

    def structural_tag_grammar(self, trigger: str, begin: str, schema: dict, end: str
                               ) -> Grammar:
        raise NotImplementedError

    def api(self) -> dict[str, str]:
        raise NotImplementedError


class LLGuidance(Backend):
    name = package = "llguidance"

    def _setup(self) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
        self.llg, self.llnp = llguidance, llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(self.hf, n_vocab=self.vocab_size,
                                                eos_token=self.eos)
        self.set_batch_threads(self.threads)
        self.vocab_size = self.tok.vocab_size

    def set_batch_threads(self, threads: int) -> None:
        self.executor = self.llg.LLExecutor(num_threads=threads)

    def grammar_text(self, g: Grammar) -> str:
        M = self.llg.LLMatcher
        try:
            if g.kind == "json_schema":
                return M.grammar_from_json_schema(g.text)
            if g.kind == "json_object":
                return M.grammar_from_json_schema({"type": "object"})
            if g.kind == "regex":
                return M.grammar_from_regex(g.text)
            if g.kind == "choice":
                return self.llg.grammar_from("choice", json.loads(g.text))
            if g.kind in ("grammar", "lark"):
                return M.grammar_from_lark(g.text)
            if g.kind == "gbnf":
                return self.llg.grammar_from("gbnf", g.text)
            if g.kind == "structural_tag":   # already a grammar (structural_tag())
                return g.text
        except ValueError as e:
            raise CompileError(str(e)) from None
        raise ValueError(f"unknown grammar kind {g.kind!r}")

    def _matcher(self, grammar: str) -> Any:
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise CompileError(m.get_error())
        return m

    def compile_cold(self, g: Grammar) -> tuple[Any, Any]:
        m = self._matcher(self.grammar_text(g))
        return m, m.deep_copy()

    def compile_again(self, g: Grammar) -> Any:
        # no compile cache in the library: the grammar is built again
        return self._matcher(self.grammar_text(g))

    def from_kept(self, kept: Any) -> Any:
        return kept.deep_copy()

    def new_bitmask(self, rows: int) -> Any:
        return self.llnp.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        self.llnp.fill_next_token_bitmask(matcher, bitmask, row)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def fill_batch(self, matchers: list[Any], bitmask: Any) -> None:
        self.llnp.fill_next_token_bitmask_par(self.executor,
                                              [(m, i) for i, m in enumerate(matchers)],
                                              bitmask)

    def consume_batch(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return self.executor.consume_token_par(list(zip(matchers, tokens)))

    def is_done(self, matcher: Any) -> bool:
        return matcher.is_stopped()

    def structural_tag_grammar(self, trigger: str, begin: str, schema: dict, end: str
                               ) -> Grammar:
        tag = self.llg.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end)
        lark = self.llg.StructTag.to_grammar([tag], assume_special=False)
        return Grammar("structural_tag", self.llg.LLMatcher.grammar_from_lark(lark))

    def api(self) -> dict[str, str]:
        return {
            "grammar syntax": "Lark (native, with regex terminals and %json); GBNF "
                              "converted to Lark in Python (grammar_from('gbnf'))",
            "batched masks": "fill_next_token_bitmask_par(LLExecutor) + consume_token_par",
            "draft-token masks (speculative)": "fill_next_token_bitmask_par_with_draft_tokens",
            "copy a matcher": "LLMatcher.deep_copy",
            "fast-forward (forced) tokens": "compute_ff_tokens / compute_ff_bytes",
            "compile cache": "none in the library (the server keeps matchers)",
            "structural tags": "StructTag.to_grammar (Lark with lazy triggers)",
            "errors": "never raises for a bad grammar: is_error()/get_error() on the "
                      "matcher, or LLMatcher.validate_grammar",
        }


def backend_class(name: str) -> type[Backend]:
    """The adapter of a backend by name. xgrammar's lives in its own module, loaded only
    here: xgrammar is the `compare` extra's, not the tests', so nothing the suite
    imports may import it."""
    if name == "llguidance":
        return LLGuidance
    if name == "xgrammar":
        return importlib.import_module("benchmarks.structured.xgrammar_adapter").XGrammar
    raise ValueError(f"unknown grammar backend {name!r}")


def installed(name: str) -> str | None:
    """The installed version of a backend, or None if it is missing or does not import."""
    try:
        version = metadata.version(name)
        __import__(name)
    except Exception:   # noqa: BLE001 - not installed, or broken (xgrammar without torch)
        return None
    return version


def package_info(name: str) -> dict[str, Any]:
    """Version, declared dependencies and the seconds `import NAME` takes in a fresh
    interpreter (xgrammar imports torch)."""
    info: dict[str, Any] = {"version": metadata.version(name),
                            "requires": [r.split(";")[0].strip()
                                         for r in metadata.requires(name) or []
                                         if "extra ==" not in r]}
    code = f"import time; t = time.perf_counter(); import {name}; print(time.perf_counter() - t)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300, check=True).stdout.strip().splitlines()
        info["import_s"] = float(out[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        info["import_s"] = None
    return info
