"""Grammar backends for structured outputs on this machine: llguidance and xgrammar.

    python -m benchmarks.structured.grammar_backends [--output-dir benchmarks/results] [--vocab-size 32000]

Every backend that imports is measured with the same tokenizer: a byte-level BPE with
real merges, trained here (no hub downloads) on generated English, JSON and code-like
text, cached under the temporary directory, wrapped as a transformers
PreTrainedTokenizerFast. A backend that is not installed is reported as such.

- compile: per grammar kind (medium and small JSON schema, json_object, regex, choice of
  4, arithmetic grammar), the cold path (nothing cached: llguidance builds the grammar
  text and an LLMatcher; xgrammar a fresh GrammarCompiler compiles and a GrammarMatcher
  is made) and the cached path a server takes for a grammar it has seen (llguidance:
  deep_copy of the kept matcher, as jaxserve.engine.grammar does; xgrammar: a
  GrammarMatcher of the kept CompiledGrammar), with the first mask after each (llguidance
  does most of its work lazily, at the masks; xgrammar ahead, at the compile).
- mask: a matcher of the medium schema is driven through a valid instance token by token
  (the instance as the tokenizer encodes it, then EOS): each step fills the next-token
  bitmask and consumes the token; every mask must allow the token that follows. One
  row with the single-matcher call; 8 and 64 rows with the library's batched calls, on 1
  thread and on all cores (rows staggered along the instance, a finished row restarts
  with a new matcher).
- features: JSON-schema keywords and grammar forms each backend compiles *and* enforces
  (a valid example accepted, an invalid one rejected), API capabilities a server needs
  (rollback, batched masks, draft masks, fork), and the error text for invalid inputs.

Timings are wall clock of the calls from Python, garbage collection off while timing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.structured.grammar_adapters import backend_class, installed, package_info
from benchmarks.structured.grammar_backend_runs import (measure_compile, measure_masks,
                                                        measure_schema_parts, timed)
from benchmarks.structured.grammar_features import feature_tables, measure_features, text_table
from benchmarks.structured.grammar_fixtures import (ARITH_GBNF, ARITH_LARK, CHOICES, EMAIL_REGEX,
                                                    MEDIUM_INSTANCE, MEDIUM_SCHEMA, SMALL_SCHEMA,
                                                    grammar_kinds, instance_text, instance_tokens)
from benchmarks.structured.grammar_tokenizer import CORPUS_VERSION, make_bpe_tokenizer, tokenizer_dir
from benchmarks.shared.results_io import write_results

# the rest of the interface tests/benchmarks/test_grammar_backends.py reaches through here
from benchmarks.structured.grammar_adapters import LLGuidance  # noqa: F401
from benchmarks.structured.grammar_backend_runs import drive_one, token_allowed  # noqa: F401
from benchmarks.structured.grammar_features import INVALID_INPUTS  # noqa: F401
from benchmarks.structured.grammar_tokenizer import EOS  # noqa: F401

BACKENDS = ("llguidance", "xgrammar")


def run_backend(name: str, hf_tokenizer: Any, *, threads: int, repeats: int, passes: int,
                batch_rows: Sequence[int], batch_steps: int,
                batch_threads: Sequence[int] | None = None, features: bool = True
                ) -> dict[str, Any]:
    """Everything measured for one backend, or {"installed": False}."""
    version = installed(name)
    if version is None:
        return {"installed": False}
    backend = backend_class(name)(hf_tokenizer, threads)
    tokens = instance_tokens(hf_tokenizer)
    out: dict[str, Any] = {"installed": True, "version": version, "threads": threads,
                           "vocab_size": backend.vocab_size,
                           "tokenizer_setup_s": backend.tokenizer_setup_s}
    out["compile"] = measure_compile(backend, grammar_kinds(), repeats)
    out["compile_medium_schema_parts_s"] = measure_schema_parts(backend, MEDIUM_SCHEMA,
                                                                max(1, min(repeats, 3)))
    out["mask"] = measure_masks(backend, tokens, passes, batch_rows, batch_steps,
                                batch_threads or [threads])
    if features:
        out["features"] = measure_features(backend, tokens)
    return out


def mask_failures(mask: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """{drive: (masks that disallowed the next token, tokens rejected)} where either
    is not 0; empty when every mask allowed the instance."""
    drives = {"rows_1": mask["rows_1"]}
    for threads, by_rows in mask.get("batched", {}).items():
        drives.update({f"{rows}_{threads}": v for rows, v in by_rows.items()})
    return {k: (v["disallowed_steps"], v["rejected_tokens"]) for k, v in drives.items()
            if v["disallowed_steps"] or v["rejected_tokens"]}


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _missing(name: str, empty_cells: int) -> list[Any]:
    return [name, "not installed"] + [None] * empty_cells


def tables(results: dict[str, Any]) -> str:
    """The Markdown of a run: compile, mask steps, features, errors, packages."""
    backends = results["backends"]
    on = [n for n, r in backends.items() if r["installed"]]
    parts = []
    rows = []
    for name, r in backends.items():
        if not r["installed"]:
            rows.append(_missing(name, 5))
            continue
        for label, c in r["compile"].items():
            if "error" in c:
                rows.append([name, label, f"error: {c['error'][:80]}", None, None, None, None])
                continue
            rows.append([name, label, _ms(c["cold_s"]), _ms(c["cold_first_mask_s"]),
                         _ms(c["again_s"]), _ms(c["kept_s"]), _ms(c["kept_first_mask_s"])])
    parts += ["## Compile (ms, median)", "",
              text_table(["backend", "grammar", "cold compile", "1st mask after cold",
                          "compile again (library alone)", "matcher from kept",
                          "1st mask after kept"], rows), ""]
    rows = []
    for name, r in backends.items():
        if not r["installed"]:
            rows.append(_missing(name, 6))
            continue
        mk = r["mask"]
        one = mk["rows_1"]
        cold = r["compile"]["json_schema (medium)"]
        first_total = (None if "error" in cold
                       else _ms(cold["cold_s"]) + one["first_pass_total_ms"])
        rows.append([name, mk["tokens_per_pass"], first_total, one["later_pass_total_ms"],
                     one["first_pass_step"]["mean_us"], one["step"]["mean_us"],
                     one["step"]["p50_us"], one["step"]["p99_us"]])
    parts += ["## Mask + consume per decode step, medium schema, 1 row", "",
              text_table(["backend", "steps (tokens + EOS)",
                          "1st request: cold compile + all steps (ms)",
                          "later request: all steps (ms)", "1st request mean (µs)",
                          "mean (µs)", "p50 (µs)", "p99 (µs)"], rows), ""]
    batch_rows = results["config"]["batch_rows"]
    rows = []
    for name, r in backends.items():
        if not r["installed"]:
            rows.append(_missing(name, 3 * len(batch_rows)))
            continue
        for threads, by_rows in r["mask"]["batched"].items():
            row = [name, threads.removeprefix("threads_")]
            for n in batch_rows:
                b = by_rows[f"rows_{n}"]
                row += [b["step"]["mean_us"], b["step"]["p99_us"], b["per_row_step_mean_us"]]
            rows.append(row)
    heads = [h for n in batch_rows for h in (f"{n} rows mean (µs)", f"{n} rows p99 (µs)",
                                             f"{n} rows mean per row (µs)")]
    parts += ["## Batched mask + consume per decode step, medium schema", "",
              text_table(["backend", "threads", *heads], rows), ""]
    rows = [[n, s["step"], json.dumps(s["after"]), json.dumps(s["token"]), s["median_us"]]
            for n in on for s in backends[n]["mask"]["rows_1"]["slowest_steps"]]
    if rows:
        parts += ["## Slowest steps of the 1-row drive (median over the later passes)", "",
                  text_table(["backend", "step", "after (last 24 chars)", "token", "µs"], rows),
                  ""]
    if on:
        props = list(MEDIUM_SCHEMA["properties"])
        rows = [[p, json.dumps(MEDIUM_SCHEMA["properties"][p])[:70]]
                + [(lambda v: _ms(v) if isinstance(v, float) else v)(
                    backends[n]["compile_medium_schema_parts_s"].get(p)) for n in on]
                for p in props]
        parts += ["## Cold compile of each medium-schema property alone (ms)", "",
                  text_table(["property", "schema", *on], rows), ""]
    parts += feature_tables(backends, [n for n in on if "features" in backends[n]])
    rows = []
    for name, r in backends.items():
        p = results["packages"].get(name)
        if p is None:
            rows.append(_missing(name, 3))
        else:
            rows.append([name, p["version"], ", ".join(p["requires"]) or "none",
                         p["import_s"], r.get("tokenizer_setup_s")])
    parts += ["## Packages", "", text_table(
        ["backend", "version", "requires", "import (s)", "tokenizer setup (s)"], rows)]
    return "\n".join(parts)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-dir", default="benchmarks/results")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--repeats", type=int, default=5, help="compiles per grammar")
    ap.add_argument("--passes", type=int, default=10,
                    help="1-row passes through the instance (the first is reported apart)")
    ap.add_argument("--batch-rows", default="8,64")
    ap.add_argument("--batch-steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads of xgrammar's compiler (and of the batched calls when "
                         "--batch-threads is not given)")
    ap.add_argument("--batch-threads", default=None,
                    help="thread counts the batched calls are measured with (default: 1 "
                         "and --threads)")
    ap.add_argument("--tokenizer-dir", default=None,
                    help="where the trained tokenizer is cached (default: a directory "
                         "under the temporary directory, per vocabulary size)")
    ap.add_argument("--name", default="grammar_backends")
    return ap


def report_notes(results: dict[str, Any]) -> list[str]:
    """What each column measures, then a warning per backend whose masks failed the
    instance (or that is not installed)."""
    notes = [
        "cold compile: llguidance = grammar text + LLMatcher(tokenizer, grammar); xgrammar = "
        "a fresh GrammarCompiler's compile_* + GrammarMatcher. llguidance defers most work "
        "to the masks (see '1st mask after cold'); xgrammar precomputes at compile",
        "compile again: the same grammar a second time through the library alone "
        "(xgrammar: its compiler cache; llguidance has none and builds it again); matcher "
        "from kept: what a server does for a grammar it has cached (llguidance: deep_copy "
        "of the kept matcher, as jaxserve.engine.grammar does; xgrammar: GrammarMatcher of "
        "the kept CompiledGrammar)",
        "json_object: llguidance = schema {\"type\": \"object\"}; xgrammar = "
        "compile_builtin_json_grammar (any JSON value, as vLLM uses it); choice: llguidance "
        "grammar_from('choice'), xgrammar an EBNF alternation; arithmetic: Lark for "
        "llguidance, the same grammar in GBNF for xgrammar",
        "mask step = fill the next-token bitmask + consume the token; 1 row: the "
        "single-matcher calls, '1st request' = the first pass of the matcher just compiled "
        "(llguidance's lazy lexer work), the other columns the later passes; batched: per "
        "batch step, llguidance fill_next_token_bitmask_par + consume_token_par on an "
        "LLExecutor, xgrammar BatchGrammarMatcher batch_fill_next_token_bitmask + "
        "batch_accept_token, rows staggered along the instance",
    ]
    for name, r in results["backends"].items():
        if r["installed"]:
            bad = mask_failures(r["mask"])
            if bad:
                notes.append(f"WARNING: {name}: masks that disallowed the instance's next "
                             f"token / tokens rejected, by rows: {bad}")
        else:
            notes.append(f"{name}: not installed (pip install {name})")
    return notes


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    ap = parser()
    args = ap.parse_args(argv)
    batch_rows = [int(x) for x in args.batch_rows.split(",") if x]
    batch_threads = ([int(x) for x in args.batch_threads.split(",") if x] if args.batch_threads
                     else sorted({1, args.threads}))
    tok_dir = args.tokenizer_dir or tokenizer_dir(args.vocab_size)
    hf, t_tok = timed(lambda: make_bpe_tokenizer(tok_dir, args.vocab_size))
    text, n_tokens = instance_text(), len(instance_tokens(hf))
    print(f"tokenizer: {len(hf)} tokens ({tok_dir}, {t_tok:.1f} s); medium instance "
          f"{len(text)} chars -> {n_tokens - 1} tokens + EOS", flush=True)
    results: dict[str, Any] = {"backends": {}, "packages": {}}
    for name in args.backends.split(","):
        print(f"{name} ...", flush=True)
        results["backends"][name] = run_backend(
            name, hf, threads=args.threads, repeats=args.repeats, passes=args.passes,
            batch_rows=batch_rows, batch_steps=args.batch_steps, batch_threads=batch_threads)
        if results["backends"][name]["installed"]:
            results["packages"][name] = package_info(name)
    config = {"vocab_size_requested": args.vocab_size, "vocab_size": len(hf),
              "tokenizer": "byte-level BPE trained on generated English / JSON / code text "
                           f"(corpus v{CORPUS_VERSION}, seed 0)",
              "tokenizer_dir": tok_dir, "tokenizer_build_or_load_s": t_tok,
              "instance_chars": len(text), "instance_tokens_with_eos": n_tokens,
              "repeats": args.repeats, "passes": args.passes, "batch_rows": batch_rows,
              "batch_steps": args.batch_steps, "threads": args.threads,
              "batch_threads": batch_threads,
              "medium_schema": MEDIUM_SCHEMA, "medium_instance": MEDIUM_INSTANCE,
              "small_schema": SMALL_SCHEMA, "regex": EMAIL_REGEX, "choices": CHOICES,
              "lark": ARITH_LARK, "gbnf": ARITH_GBNF}
    results["config"] = config
    table = tables(results)
    write_results(args.output_dir, args.name, benchmark="grammar_backends", argv=argv,
                  config=config, results=results, table=table,
                  notes=report_notes(results))
    return results


if __name__ == "__main__":
    main()
