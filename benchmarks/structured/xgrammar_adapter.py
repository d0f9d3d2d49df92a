"""The xgrammar adapter of grammar_adapters.Backend, in a module of its own:
grammar_adapters.backend_class loads it by name, so that the modules the tests import
never import xgrammar (the `compare` extra's, which the test command does not install)."""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import xgrammar

from benchmarks.structured.grammar_adapters import Backend, CompileError
from benchmarks.structured.grammar_fixtures import ARITH_GBNF, ARITH_LARK, Grammar


class XGrammar(Backend):
    name = package = "xgrammar"

    def _setup(self) -> None:
        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            self.hf, vocab_size=self.vocab_size, stop_token_ids=[self.eos])
        self.compiler = self._compiler()
        self.set_batch_threads(self.threads)

    def set_batch_threads(self, threads: int) -> None:
        self.batch = self.xgr.BatchGrammarMatcher(max_threads=threads)

    def _compiler(self) -> Any:
        return self.xgr.GrammarCompiler(self.info, max_threads=self.threads)

    def _compile(self, compiler: Any, g: Grammar) -> Any:
        try:
            if g.kind == "json_schema":
                return compiler.compile_json_schema(g.text)
            if g.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if g.kind == "regex":
                return compiler.compile_regex(g.text)
            if g.kind == "choice":   # as vLLM does: an EBNF alternation
                alts = " | ".join(json.dumps(c) for c in json.loads(g.text))
                return compiler.compile_grammar(f"root ::= {alts}")
            if g.kind == "grammar":  # the same arithmetic grammar, in xgrammar's EBNF
                return compiler.compile_grammar(ARITH_GBNF if g.text == ARITH_LARK
                                                else g.text)
            if g.kind == "gbnf":
                return compiler.compile_grammar(g.text)
            if g.kind == "lark":
                return compiler.compile_lark(g.text)
            if g.kind == "structural_tag":
                return compiler.compile_structural_tag(g.text)
        except Exception as e:   # noqa: BLE001 - RuntimeError, InvalidJSONError, ...
            raise CompileError(f"{type(e).__name__}: {e}") from None
        raise ValueError(f"unknown grammar kind {g.kind!r}")

    def compile_cold(self, g: Grammar) -> tuple[Any, Any]:
        self.compiler = self._compiler()   # an empty cache
        compiled = self._compile(self.compiler, g)
        return self.xgr.GrammarMatcher(compiled), compiled

    def compile_again(self, g: Grammar) -> Any:
        return self.xgr.GrammarMatcher(self._compile(self.compiler, g))

    def from_kept(self, kept: Any) -> Any:
        return self.xgr.GrammarMatcher(kept)

    def new_bitmask(self, rows: int) -> Any:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    @staticmethod
    def bits(bitmask: Any) -> np.ndarray:
        return bitmask.numpy()

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def fill_batch(self, matchers: list[Any], bitmask: Any) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume_batch(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def is_done(self, matcher: Any) -> bool:
        return matcher.is_terminated()

    def structural_tag_grammar(self, trigger: str, begin: str, schema: dict, end: str
                               ) -> Grammar:
        tag = {"type": "structural_tag",
               "format": {"type": "triggered_tags", "triggers": [trigger],
                          "tags": [{"type": "tag", "begin": begin, "end": end,
                                    "content": {"type": "json_schema",
                                                "json_schema": schema}}]}}
        return Grammar("structural_tag", json.dumps(tag))

    def api(self) -> dict[str, str]:
        return {
            "grammar syntax": "EBNF (GBNF dialect) via compile_grammar; Lark via "
                              "compile_lark",
            "batched masks": "BatchGrammarMatcher.batch_fill_next_token_bitmask + "
                             "batch_accept_token",
            "draft-token masks (speculative)": "GrammarMatcher.traverse_draft_tree "
                                               "(torch tensors)",
            "copy a matcher": "GrammarMatcher.fork (or a new GrammarMatcher of the "
                              "CompiledGrammar)",
            "fast-forward (forced) tokens": "find_jump_forward_string",
            "compile cache": "GrammarCompiler(cache_enabled=True), keyed by grammar",
            "structural tags": "compile_structural_tag (triggered_tags, tags, regex, "
                               "grammar, token formats)",
            "errors": "raises at compile (RuntimeError, InvalidJSONError, ...)",
        }
