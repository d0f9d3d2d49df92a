"""Constrained decoding's CPU cost: the token mask's per-step overhead, grammar compiles.

    python -m benchmarks.structured.structured_overhead [--output-dir benchmarks/results] \\
        [--rows 8,64] [--steps 40] [--repeats 5] [--compile-repeats 10]

Why: the sampler program applies a token bitmask and logit bias every step whatever the
rows carry; what a constraint adds is host work: InputBatch._constraint_tensors copies
static mask rows and fills each grammar row from its llguidance matcher (Python, row by
row) before the step, append_sampled advances each matcher by its token after it.

Model: the small random Qwen3 of the CPU figures (common.SMALL_QWEN3, float32) with the
trained byte-level BPE of grammar_tokenizer.py (32000 tokens, real JSON punctuation);
one LLM, max_num_seqs = the largest --rows. For each R and scenario (none; json_schema:
grammar_fixtures.MEDIUM_SCHEMA, flexible whitespace; json_object; allowed_token_ids:
2000 per row; logit_bias: 50 per row), R requests (16 random prompt tokens, temperature
1, a seed each) enter by the front door and the engine steps. A step counts only if all
R rows decode one token (each has its first token, R tokens scheduled, none finished
before); after --steps counted steps or the first finish the rest is aborted. --repeats
runs each, scenarios interleaved; runs cut short are topped up (at most 3x the runs).
Reported: median / p90 engine.step() ms, host ms per step inside _constraint_tensors
(mask) and append_sampled (accept), wrapped on the instance, and the ratio to `none`.
Compile: the front door's GrammarCompiler.compile of the medium schema, cold (a fresh
description each time: a new cache key) and cached (the same schema again), and the
first mask after it (matcher() + one fill: llguidance builds lazily).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

from benchmarks.shared.common import SMALL_QWEN3, make_qwen3
from benchmarks.structured.grammar_fixtures import MEDIUM_SCHEMA
from benchmarks.structured.grammar_tokenizer import EOS, make_bpe_tokenizer, tokenizer_dir
from benchmarks.shared.results_io import cpu_snapshot, markdown_table, other_load, write_results

SCENARIOS = ("none", "json_schema", "json_object", "allowed_token_ids", "logit_bias")
PROMPT_LEN, NUM_ALLOWED, NUM_BIAS = 16, 2000, 50
TIMED = ("_constraint_tensors", "append_sampled")   # InputBatch methods timed per step
MODEL_DIR = os.path.join(tempfile.gettempdir(), "jaxserve-bench-qwen3-small-bpe")


def model_dir(path: str = MODEL_DIR, vocab: int = 32000) -> str:
    """The small random Qwen3 with the trained byte-level BPE as its tokenizer."""
    from transformers import AutoTokenizer
    make_qwen3(path, {**SMALL_QWEN3, "vocab_size": vocab})   # reused when already there
    if AutoTokenizer.from_pretrained(path).eos_token != EOS:   # still the word tokenizer
        make_bpe_tokenizer(src := tokenizer_dir(vocab), vocab)  # trained once, cached
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if os.path.exists(f := os.path.join(path, name)):
                os.remove(f)
        for name in os.listdir(src):
            shutil.copy(os.path.join(src, name), path)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == vocab, (len(tok), vocab)
    assert tok.eos_token == tok.bos_token == EOS and tok.eos_token_id == 0, tok
    return path


def scenario_params(scenario: str, seed: int, vocab: int, max_tokens: int,
                    eos_ids: tuple[int, ...]) -> Any:
    """One request's SamplingParams; allowed and biased ids avoid the eos ids."""
    from jaxserve import SamplingParams, StructuredOutputsParams as SO
    rng = random.Random(seed)
    ids = [t for t in range(vocab) if t not in eos_ids]
    extra: dict[str, Any] = {
        "none": {},
        "json_schema": {"structured_outputs": SO(json=MEDIUM_SCHEMA)},
        "json_object": {"structured_outputs": SO(json_object=True)},
        "allowed_token_ids": {"allowed_token_ids": rng.sample(ids, min(NUM_ALLOWED,
                                                                       vocab // 2))},
        "logit_bias": {"logit_bias": {t: rng.uniform(-5.0, 5.0)
                                      for t in rng.sample(ids, min(NUM_BIAS, vocab // 4))}},
    }[scenario]
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, **extra)


def time_methods(batch: Any, acc: dict[str, float]) -> Callable[[], None]:
    """Wraps the TIMED bound methods on the batch instance (no library change) to add
    their seconds to `acc`; returns the undo."""
    def wrap(name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name] += time.perf_counter() - t0
        return timed
    for n in TIMED:
        setattr(batch, n, wrap(n, getattr(batch, n)))

    def undo() -> None:
        for n in TIMED:
            del batch.__dict__[n]
    return undo


def check_idle(engine: Any) -> None:
    """No request left, every KV page free, no row left in the runner's batch (an empty
    step drops the aborted rows from it, as the next run's first step would)."""
    engine.step()
    assert not engine.has_unfinished_requests(), engine.scheduler.requests
    assert engine.scheduler.kv.get_num_free_pages() == engine.info.num_pages - 1
    assert not engine.runner.batch.row_of, engine.runner.batch.row_of


def all_decoding(sched: Any, rids: list[str]) -> bool:
    return all((r := sched.get_request(rid)) is not None and not r.is_finished()
               and r.num_output_tokens > 0 for rid in rids)


def run_scenario(llm: Any, rows: int, scenario: str, steps: int, seed: int,
                 max_tokens: int) -> dict[str, Any]:
    """R requests of `scenario` through the front door, stepped until `steps` all-rows
    decode steps were timed or a request finished; the rest aborted. -> step seconds,
    host seconds per step in each TIMED method, each row's text and how it ended."""
    engine, tok = llm.engine, llm.get_tokenizer()
    vocab, eos = engine.inputs.vocab_size, tuple(engine.info.eos_token_ids)
    rng = random.Random(seed)
    rids = [f"{scenario}-{rows}-{seed}-{i}" for i in range(rows)]
    for i, rid in enumerate(rids):
        prompt = [rng.randrange(max(eos, default=0) + 1, vocab) for _ in range(PROMPT_LEN)]
        params = scenario_params(scenario, seed * 1000 + i, vocab, max_tokens, eos)
        engine.add_request(engine.inputs.process(rid, prompt, params))
    acc, compiles = dict.fromkeys(TIMED, 0.0), engine.num_compilations
    undo = time_methods(engine.runner.batch, acc)
    step_s: list[float] = []
    host_s: dict[str, list[float]] = {n: [] for n in TIMED}
    ids, ends = {}, {}
    try:
        while len(step_s) < steps and engine.has_unfinished_requests():
            ready, tokens, before = (all_decoding(engine.scheduler, rids),
                                     engine.num_scheduled_tokens, dict(acc))
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            if ready and engine.num_scheduled_tokens - tokens == rows:
                step_s.append(dt)
                for n in TIMED:
                    host_s[n].append(acc[n] - before[n])
            for o in outs:   # finished requests only (the LLM does not stream)
                ids[o.request_id], ends[o.request_id] = (o.outputs[0].token_ids,
                                                         o.outputs[0].finish_reason)
            if ready and outs:   # from here on the batch is no longer all R rows
                break
    finally:
        undo()
        for rid in rids:
            out = engine.abort_request(rid)
            if out is not None:   # its text is not detokenized: decoded below
                ids[rid], ends[rid] = out.outputs[0].token_ids, "aborted"
        check_idle(engine)
    return {"rows": rows, "scenario": scenario, "seed": seed, "step_s": step_s,
            "host_s": host_s, "ends": [ends[r] for r in rids],
            "texts": [tok.decode(ids[r], skip_special_tokens=True) for r in rids],
            "compilations": engine.num_compilations - compiles}


def parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def ms_pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q) * 1e3) if xs else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled figures of the runs of one (R, scenario), times in ms."""
    steps = [s for r in runs for s in r["step_s"]]
    host = {n: [x for r in runs for x in r["host_s"][n]] for n in TIMED}
    texts = [t for r in runs for t in r["texts"]]
    return {"rows": runs[0]["rows"], "scenario": runs[0]["scenario"],
            "steps_counted": len(steps), "steps_per_run": [len(r["step_s"]) for r in runs],
            "median_step_ms": ms_pct(steps, 50), "p90_step_ms": ms_pct(steps, 90),
            "host_mask_ms": ms_pct(host["_constraint_tensors"], 50),
            "host_accept_ms": ms_pct(host["append_sampled"], 50),
            "finished_rows": sum(e == "stop" for r in runs for e in r["ends"]),
            "complete_json_rows": sum(parses(t) for t in texts),
            "compilations": sum(r["compilations"] for r in runs),
            "other_processes_cores": [r.get("other_processes_cores") for r in runs],
            "step_ms_each": [[s * 1e3 for s in r["step_s"]] for r in runs],
            "sample_text": texts[0][:160] if texts else ""}


def run_steps(llm: Any, rows_list: list[int], scenarios: list[str], steps: int,
              repeats: int, max_tokens: int) -> list[dict[str, Any]]:
    """Each (R, scenario) `repeats` times, scenarios interleaved, after one short untimed
    run per R; a scenario whose runs ended early (a row finished) gets more runs until
    it has steps x repeats steps or 3x the runs. -> summaries with `vs_none`."""
    out = []
    for rows in rows_list:
        run_scenario(llm, rows, "none", 3, seed=10_000 + rows, max_tokens=max_tokens)
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in scenarios}

        def run(scenario: str) -> None:
            start, seed = cpu_snapshot(), 100 * len(runs[scenario]) + scenarios.index(scenario)
            r = run_scenario(llm, rows, scenario, steps, seed, max_tokens)
            runs[scenario].append({**r, "other_processes_cores": other_load(start)})
            print(f"R={rows} {scenario} seed {seed}: {len(r['step_s'])} steps, median "
                  f"{statistics.median(r['step_s'] or [0]) * 1e3:.1f} ms", file=sys.stderr)
        for _ in range(repeats):
            for scenario in scenarios:
                run(scenario)
        for scenario in scenarios:
            while (sum(len(r["step_s"]) for r in runs[scenario]) < steps * repeats
                   and len(runs[scenario]) < 3 * repeats):
                run(scenario)
        out += [{**summarize(runs[s]), **versus_none(runs, s, repeats)} for s in scenarios]
    return out


def versus_none(runs: dict[str, list[dict[str, Any]]], scenario: str,
                repeats: int) -> dict[str, float | None]:
    """vs_none: pooled median step / none's; vs_none_paired: the median over repeats of
    (this run's median / the none run's of the same repeat: run-to-run drift cancels);
    host_extra_ms: median (mask + accept) ms per step minus none's."""
    if "none" not in runs:
        return {"vs_none": None, "vs_none_paired": None, "host_extra_ms": None}
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    pooled = [med([t for r in runs[k] for t in r["step_s"]]) for k in (scenario, "none")]
    pairs = [med(a["step_s"]) / med(b["step_s"])
             for a, b in zip(runs[scenario][:repeats], runs["none"]) if a["step_s"]]
    host = [med([sum(x) for r in runs[k] for x in zip(*r["host_s"].values())])
            for k in (scenario, "none")]
    return {"vs_none": pooled[0] / pooled[1] if None not in pooled else None,
            "vs_none_paired": med(pairs),
            "host_extra_ms": (host[0] - host[1]) * 1e3 if None not in host else None}


def schema_variant(tag: str) -> dict[str, Any]:
    """The medium schema with another description: a new cache key, the same grammar."""
    return {**MEDIUM_SCHEMA, "description": f"benchmark variant {tag}"}


def compile_times(llm: Any, repeats: int) -> dict[str, Any]:
    """ms of GrammarCompiler.compile, cold (a fresh variant each time) and cached (the
    same schema again), and of the first mask of the cold grammar (matcher() + fill),
    then of another matcher of it; the process's first compile and mask apart."""
    from jaxserve import StructuredOutputsParams as SO
    from jaxserve.runner.sampling_tensors import mask_words
    from jaxserve.runner.token_constraints import ALL_ALLOWED
    compiler = llm.engine.inputs.grammar_compiler()
    words = mask_words(llm.engine.inputs.vocab_size)

    def ms(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def first_mask(grammar: Any) -> float:
        mask = np.full(words, ALL_ALLOWED, np.uint32)
        took = ms(lambda: grammar.matcher().fill(mask))
        assert 0 < np.count_nonzero(mask) < words / 4   # `{` and whitespace only
        return took
    so0 = SO(json=schema_variant(f"first {time.time_ns()}"))
    first = ms(lambda: compiler.compile(so0))
    first_mask_ever = first_mask(compiler.compile(so0))   # llguidance warms up once
    res: dict[str, list[float]] = {k: [] for k in ("cold", "cached", "first_mask",
                                                   "second_matcher_mask")}
    for i in range(repeats):
        so = SO(json=schema_variant(f"{i} {time.time_ns()}"))
        res["cold"].append(ms(lambda: compiler.compile(so)))
        res["cached"].append(ms(lambda: compiler.compile(SO(json=dict(so.json)))))
        grammar = compiler.compile(so)
        res["first_mask"].append(first_mask(grammar))
        res["second_matcher_mask"].append(first_mask(grammar))
    return {"first_compile_ms": first, "first_mask_of_the_process_ms": first_mask_ever,
            "repeats": repeats, "samples_ms": res,
            **{f"{k}_median_ms": statistics.median(v) for k, v in res.items()}}


def tables(steps: list[dict[str, Any]], comp: dict[str, Any]) -> str:
    step_table = markdown_table(
        ["rows", "scenario", "median step ms", "p90 step ms", "host mask ms/step",
         "host accept ms/step", "host ms/step over none", "steps counted", "vs none",
         "vs none, paired"],
        [[s["rows"], s["scenario"], s["median_step_ms"], s["p90_step_ms"], s["host_mask_ms"],
          s["host_accept_ms"], s["host_extra_ms"], s["steps_counted"],
          *(None if s[k] is None else f"{s[k]:.3f}x" for k in ("vs_none", "vs_none_paired"))]
         for s in steps])
    comp_table = markdown_table(["medium JSON schema", "ms"], [
        ["first compile of the engine (+ llguidance tokenizer)", comp["first_compile_ms"]],
        [f"compile, cold (median of {comp['repeats']})", comp["cold_median_ms"]],
        ["compile, cached (same schema again)", comp["cached_median_ms"]],
        ["its first mask (matcher() + fill): the process's first",
         comp["first_mask_of_the_process_ms"]],
        ["first mask after a cold compile (matcher() + fill)", comp["first_mask_median_ms"]],
        ["first mask of another matcher of it", comp["second_matcher_mask_median_ms"]]])
    return step_table + "\n\n" + comp_table


NOTES = [
    "step ms: wall time of engine.step() (schedule, forward, sampling, host mask and grammar "
    "work, output processing) over steps in which all R rows decode one token and none had "
    "finished; median and p90 pooled over the runs",
    "host mask / accept ms/step: time inside InputBatch._constraint_tensors (static mask "
    "rows copied, grammar rows filled by llguidance) / append_sampled (each grammar "
    "consumes its sampled token), medians per step; both are part of the step time; "
    "host ms/step over none: the median of their sum minus none's",
    "vs none: pooled median step / none's; paired: the median over repeats of the run's "
    "median / the none run's median of the same repeat (slow run-to-run drift cancels)",
    "compile: GrammarCompiler.compile, the front door's; cold = a fresh description string "
    "each time (a new cache key); the engine's first compile also builds llguidance's "
    "tokenizer"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-dir", default="benchmarks/results")
    ap.add_argument("--name", default="structured_overhead")
    ap.add_argument("--model", default=None, help=f"checkpoint dir (default: {MODEL_DIR})")
    ap.add_argument("--rows", default="8,64")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--steps", type=int, default=40, help="all-rows decode steps per run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compile-repeats", type=int, default=10)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = ap.parse_args(argv)
    rows_list = sorted(int(r) for r in args.rows.split(","))
    scenarios = args.scenarios.split(",")
    if unknown := set(scenarios) - set(SCENARIOS):
        ap.error(f"--scenarios: unknown {sorted(unknown)}; choose from {SCENARIOS}")
    from jaxserve import LLM
    path, t0 = args.model or model_dir(), time.perf_counter()
    llm = LLM(path, dtype="float32", max_model_len=args.max_model_len,
              max_num_seqs=rows_list[-1], max_num_batched_tokens=args.max_num_batched_tokens)
    startup_s = time.perf_counter() - t0
    eos = llm.engine.info.eos_token_ids   # the tokenizer's eos ends the grammar's output
    assert eos and eos[0] == llm.get_tokenizer().eos_token_id, eos
    comp = compile_times(llm, args.compile_repeats)
    max_tokens = args.max_model_len - PROMPT_LEN
    steps = run_steps(llm, rows_list, scenarios, args.steps, args.repeats, max_tokens)
    loads = [x for s in steps for x in s["other_processes_cores"] if x is not None]
    short = [f"{s['scenario']} at R={s['rows']}: {s['steps_counted']} steps in "
             f"{len(s['steps_per_run'])} runs ({s['finished_rows']} rows finished with EOS, "
             f"as the grammar allows once the JSON is complete)"
             for s in steps if s["steps_counted"] < args.steps * args.repeats]
    write_results(args.output_dir, args.name, benchmark="structured_overhead",
                  argv=sys.argv[1:] if argv is None else argv,
                  config={**vars(args), "model": path, "startup_s": startup_s,
                          "max_tokens": max_tokens, "prompt_len": PROMPT_LEN,
                          "num_allowed_ids": NUM_ALLOWED, "num_bias": NUM_BIAS},
                  results={"steps": steps, "compile": comp}, table=tables(steps, comp),
                  notes=[*NOTES, *short, f"most other-process load during a run: "
                         f"{max(loads, default=0):.2f} cores (runs under 1 s are not measured)"])


if __name__ == "__main__":
    main()
