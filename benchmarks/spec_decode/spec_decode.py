"""Speculative decoding, ngram (prompt lookup): an engine with it vs one without, on CPU.

    python -m benchmarks.spec_decode.spec_decode [--output-dir benchmarks/results] \\
        [--model-kind llama|qwen3_5] [--model DIR] [--num-spec 3] \\
        [--prompt-lookup-min 2 --prompt-lookup-max 5] [--repeats 7] \\
        [--code-requests 8 --code-lines 16 --code-output 256 --bs1-requests 4] \\
        [--random-requests 8 --random-input 256 --random-output 256] [--name NAME] \\
        [--workloads code-edit,code-edit-bs1,random,random-t1]

Model: a random-weight checkpoint written once by tests.checkpoints.make_tiny_checkpoint
(or --model DIR): --model-kind llama (default; hidden 256, 4 layers, vocab 4096, float32)
or qwen3_5 (the hybrid of benchmarks/cache/hybrid_prefix_cache.py: hidden 256, 6 Gated DeltaNet
+ 2 full-attention layers, vocab 4096), under $TMPDIR/jaxserve-bench-spec-<kind>. Its
tokenizer is the tests' tiny byte-level BPE (256 tokens): the code workload is text.

Workloads (seeded by --seed; eos ignored, so every request makes exactly its length):
- code-edit: --code-requests prompts, all sent at once. Each holds a seeded, procedurally
  written Python module (--code-lines statements in a few functions), an instruction
  to rewrite it with one identifier renamed, and the start of the answer ("```python\\n"
  and the module's first line with the new name); --code-output tokens, greedy.
- code-edit-bs1: the first --bs1-requests of those prompts, one at a time (batch 1,
  where speculation is meant to cut the time per token).
- random: --random-requests prompts of --random-input uniform random token ids
  (benchmarks/shared/workloads.py's random dataset), --random-output tokens, greedy.
- random-t1: the same prompts sampled at temperature 1 with a seed per request: the
  output is close to random text, so prompt lookup finds (almost) nothing to propose:
  the case where speculation can only cost.

A random model does not copy its prompt, so the drafts a lookup finds in the prompt are
rejected. The random llama's greedy output falls instead into short loops of its own
tokens after a few steps (a handful of distinct tokens per output), and the lookup then
predicts the loop from the model's own earlier output: its acceptance is the model's
repetitiveness, not a code-editing model's copying. The random Qwen3.5's greedy output
does not loop (most of its tokens are distinct), so there the lookup rarely finds a
draft and most are rejected: the low-acceptance case. Each run also replays the lookup
over the final tokens (`simulated`, exact: drafts depend only on the tokens so far)
and counts where each accepted draft was found, in the prompt or in the output.

Both engines (speculative_config None and {"method": "ngram", ...}; otherwise the same
settings) live in one process and are warmed up (compilation at start-up, then one
short untimed run of each kind of request); each workload runs --repeats times per
engine on a reset prefix cache, the two taking turns to go first; timings are medians.

Reported per workload and engine: output tokens/s (output tokens over wall time); TPOT
per request = (e2e - TTFT) / (output tokens - 1) from RequestOutput.metrics (mean and
median over requests); TTFT; engine steps and tokens computed on device; the scheduler's
speculative counters for the run: drafts (rows that verified drafts), draft tokens,
accepted tokens, acceptance rate (accepted / draft tokens), mean acceptance length
(1 + accepted / drafts), acceptance per position (accepted at j / drafts); the host's
time per step by phase (schedule, dispatch = input build + launch, collect = the wait
for the device + reading the tokens back (propose included), propose, scheduler update,
output processing), measured by wrapping those methods on the engine instances; each
step's time by its kind (prefill; decode: one token per row; verify: some row verifies
drafts; recompute: a hybrid's rows computing again the tokens of a step that rejected
drafts); the process's CPU time (user + system), which other processes on a shared
machine disturb less than wall time; and greedy agreement (every run of both engines
token for token the same).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.shared.results_io import write_results
from benchmarks.spec_decode.spec_decode_replay import add_sims, simulate
from benchmarks.spec_decode.spec_decode_report import notes, tables
from benchmarks.spec_decode.spec_decode_runs import (ENGINES, agreement, instrument,
                                                     make_params, pooled, run_once, summarize,
                                                     warm_up)
from benchmarks.spec_decode.spec_decode_workload import code_prompts

MODEL_DIR = os.path.join(tempfile.gettempdir(), "jaxserve-bench-spec-{kind}")
VOCAB = 4096
LLAMA_CONFIG = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    vocab_size=VOCAB, max_position_embeddings=2048)
KINDS = ("llama", "qwen3_5")
WORKLOADS = ("code-edit", "code-edit-bs1", "random", "random-t1")


def model_config(kind: str) -> dict[str, Any]:
    if kind == "llama":
        return dict(LLAMA_CONFIG)
    from benchmarks.cache.hybrid_prefix_cache import MODEL_CONFIG
    return {**MODEL_CONFIG, "vocab_size": VOCAB}


def model_vocab(path: str) -> int:
    """The checkpoint's vocabulary size (a Qwen3.5 keeps it under text_config)."""
    import json
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    return cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]


def model_dir(kind: str, path: str | None = None) -> str:
    """The random checkpoint of this benchmark, written once (reused when there)."""
    path = path or MODEL_DIR.format(kind=kind)
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    from tests.checkpoints import make_tiny_checkpoint
    return make_tiny_checkpoint(kind, path, **model_config(kind))


def run_workload(name: str, engines: dict[str, Any], profs: dict[str, Any],
                 prompts: list[list[int]], params: list[Any], batch: int, repeats: int,
                 lookup: tuple[int, int, int]) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ENGINES}
    for rep in range(repeats):
        for k in (ENGINES if rep % 2 == 0 else ENGINES[::-1]):
            runs[k].append(run_once(engines[k], profs[k], prompts, params, batch))
        print(f"{name} repeat {rep + 1}/{repeats}: " + ", ".join(
            f"{k} {runs[k][rep]['wall_s']:.2f} s" for k in ENGINES), file=sys.stderr, flush=True)
    res = {k: pooled([summarize(r) for r in v]) for k, v in runs.items()}
    n_min, n_max, k = lookup
    sims = [simulate(p, r["output"], n_min, n_max, k, sp.max_tokens)
            for p, r, sp in zip(prompts, runs["spec"][0]["requests"], params)]
    sim = add_sims(sims)
    s = res["spec"]
    sim["matches_engine"] = (sim["drafts"] == s["num_drafts"]
                             and sim["draft_tokens"] == s["num_draft_tokens"]
                             and sim["accepted"] == s["num_accepted_tokens"])
    b = res["base"]
    outs = [r["output"] for r in runs["base"][0]["requests"]]
    paired = [rs["out_tok_s"] / rb["out_tok_s"] for rs, rb in zip(s["repeats"], b["repeats"])]
    return {"workload": name, "requests": len(prompts), "batch": batch,
            "sampling": "greedy" if params[0].temperature == 0 else "temperature 1, seeded",
            "prompt_lens": [len(p) for p in prompts], "max_tokens": params[0].max_tokens,
            "runs": res, "agreement": agreement(runs), "simulated": sim,
            "distinct_output_tokens_mean": statistics.fmean(len(set(o)) for o in outs),
            "throughput_ratio": s["out_tok_s"] / b["out_tok_s"],
            "throughput_ratio_paired": statistics.median(paired),
            "throughput_ratio_paired_each": paired,
            "cpu_time_ratio": b["cpu_s"] / s["cpu_s"],
            "tpot_mean_speedup": (b["tpot_mean_ms"] / s["tpot_mean_ms"]
                                  if s["tpot_mean_ms"] else None),
            "tpot_median_speedup": (b["tpot_median_ms"] / s["tpot_median_ms"]
                                    if s["tpot_median_ms"] else None),
            "steps_ratio": s["steps"] / b["steps"]}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = ap.add_argument
    a("--output-dir", default="benchmarks/results")
    a("--name", default=None, help="results file name (default spec_decode, "
      "spec_decode_<kind> for another model kind)")
    a("--model-kind", choices=KINDS, default="llama")
    a("--model", default=None, help="checkpoint dir (default: written on first use)")
    a("--seed", type=int, default=0)
    a("--num-spec", type=int, default=3, help="num_speculative_tokens")
    a("--prompt-lookup-min", type=int, default=2)
    a("--prompt-lookup-max", type=int, default=5)
    a("--code-requests", type=int, default=8)
    a("--code-lines", type=int, default=16, help="statements of each prompt's code")
    a("--code-output", type=int, default=256)
    a("--bs1-requests", type=int, default=4, help="code prompts run one at a time (0: skip)")
    a("--random-requests", type=int, default=8)
    a("--random-input", type=int, default=256)
    a("--random-output", type=int, default=256)
    a("--max-num-seqs", type=int, default=8)
    a("--max-num-batched-tokens", type=int, default=512)
    a("--max-model-len", type=int, default=2048)
    a("--page-size", type=int, default=16)
    a("--repeats", type=int, default=7)
    a("--workloads", default=",".join(WORKLOADS), help="which to run, comma-separated")
    return ap


def start_engines(path: str, args: argparse.Namespace, spec: dict[str, Any],
                  warm_prompts: list[list[int]]) -> tuple[dict[str, Any], dict[str, Any],
                                                          dict[str, float]]:
    """Both engines (the same settings but speculation), warmed up, then instrumented ->
    the engines, their profiles and their start-up seconds."""
    from jaxserve import LLM
    kw = dict(dtype="float32", max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              page_size=args.page_size, max_num_batched_tokens=args.max_num_batched_tokens)
    engines, profs, startup = {}, {}, {}
    for k in ENGINES:
        t0 = time.perf_counter()
        engines[k] = LLM(path, speculative_config=spec if k == "spec" else None, **kw)
        startup[k] = time.perf_counter() - t0
    for k in ENGINES:
        t0 = time.perf_counter()
        warm_up(engines[k], warm_prompts, args.seed + 99)
        startup[k] += time.perf_counter() - t0
        profs[k] = instrument(engines[k])
    return engines, profs, startup


def workload_plan(args: argparse.Namespace, code: list[list[int]],
                  rnd: list[list[int]]) -> list[tuple[str, list[list[int]], list[Any], int]]:
    """Every workload as (name, prompts, sampling params, batch)."""
    greedy = make_params("greedy", args.code_output, len(code), 0)
    plan = [("code-edit", code, greedy, len(code))]
    if args.bs1_requests:
        n = min(args.bs1_requests, len(code))
        plan.append(("code-edit-bs1", code[:n], greedy[:n], 1))
    plan += [("random", rnd, make_params("greedy", args.random_output, len(rnd), 0), len(rnd)),
             ("random-t1", rnd, make_params("t1", args.random_output, len(rnd), args.seed + 7),
              len(rnd))]
    return plan


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = parser()
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    chosen = args.workloads.split(",")
    if unknown := sorted(set(chosen) - set(WORKLOADS)):
        ap.error(f"unknown workloads {unknown}: choose from {', '.join(WORKLOADS)}")
    name = args.name or ("spec_decode" if args.model_kind == "llama"
                         else f"spec_decode_{args.model_kind}")

    from transformers import AutoTokenizer

    from benchmarks.shared.workloads import random_workload
    path = model_dir(args.model_kind, args.model)
    vocab = model_vocab(path)
    code = code_prompts(AutoTokenizer.from_pretrained(path), args.code_requests,
                        args.code_lines, args.seed)
    rnd = [it.prompt_token_ids for it in random_workload(
        args.random_requests, args.random_input, args.random_output, 0.0, vocab,
        args.seed + 1).items]
    need = max(max(len(p) for p in code) + args.code_output,
               args.random_input + args.random_output)
    if need > args.max_model_len:
        ap.error(f"--max-model-len {args.max_model_len} is below the longest request ({need})")

    spec = {"method": "ngram", "num_speculative_tokens": args.num_spec,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min}
    engines, profs, startup = start_engines(path, args, spec, rnd)
    lookup = (args.prompt_lookup_min, args.prompt_lookup_max, args.num_spec)
    t_all = time.perf_counter()
    workloads = [run_workload(wname, engines, profs, prompts, params, batch, args.repeats,
                              lookup) for wname, prompts, params, batch
                 in workload_plan(args, code, rnd) if wname in chosen]
    import jax
    num_params = sum(x.size for x in jax.tree.leaves(engines["base"].engine.params)) \
        if hasattr(engines["base"].engine, "params") else 0
    res = {"model": {"kind": args.model_kind, "path": path, "num_params": num_params,
                     "vocab_size": vocab,
                     "config": model_config(args.model_kind) if args.model is None else None},
           "speculative_config": spec, "startup_s": startup,
           "workloads_s": time.perf_counter() - t_all, "workloads": workloads}
    write_results(args.output_dir, name, benchmark="spec_decode", argv=argv, config=vars(args),
                  results=res, table=tables(res), notes=notes(res, args),
                  agreement={w["workload"]: w["agreement"] for w in workloads})
    return res


if __name__ == "__main__":
    main()
