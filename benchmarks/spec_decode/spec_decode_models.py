"""Speculative decoding with a model drafter (mtp, draft_model) on CPU: the mechanics.

    python -m benchmarks.spec_decode.spec_decode_models [--output-dir benchmarks/results] \\
        [--num-spec 2] [--requests 8 --input 128 --output 128] [--repeats 3]

Random weights, so acceptance says nothing about a trained MTP layer or draft model;
what this measures is what the machinery costs and gives:

- qwen3_5 + mtp: the hybrid of benchmarks/spec_decode/spec_decode.py's qwen3_5 with a random MTP
  layer (tests.checkpoints.add_mtp_layer). Its drafts are essentially never accepted,
  so every step verifies k rejected drafts: the cost of drafting (the MTP catch-up and
  k - 1 steps) and of verifying (1 + k tokens per row through the target, a hybrid's
  state backup, and the accepted token computed again after the rollback).
- llama + draft_model = the target itself: every greedy draft is accepted (the draft
  model computes what the target computes), 1 + k tokens per step: the most the
  mechanism gives, against a drafter as costly as the target.

Each pair (no speculation / speculation) runs in one process, both warmed up, taking
turns, medians of --repeats; greedy outputs must be identical. Random workload
(benchmarks/shared/workloads.random_workload), all requests at once.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from benchmarks.shared.results_io import write_results
from benchmarks.spec_decode.spec_decode import model_dir, model_vocab
from benchmarks.spec_decode.spec_decode_runs import (ENGINES, agreement, instrument,
                                                     make_params, pooled, run_once, summarize,
                                                     warm_up)

CASES = ("qwen3_5+mtp", "llama+draft_model")


def checkpoint(kind: str) -> str:
    """The benchmark model of `kind`; the hybrid with a random MTP layer added."""
    path = model_dir(kind)
    if kind != "qwen3_5":
        return path
    from tests.checkpoints import add_mtp_layer
    mtp = path + "-mtp"
    if not os.path.exists(os.path.join(mtp, "tokenizer.json")):
        import shutil
        shutil.copytree(path, mtp)
        add_mtp_layer(mtp)
    return mtp


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.shared.workloads import random_workload
    from jaxserve import LLM
    kind, method = case.split("+")
    path = checkpoint(kind)
    spec = {"method": method, "num_speculative_tokens": args.num_spec}
    if method == "draft_model":
        spec["model"] = path
    prompts = [it.prompt_token_ids for it in random_workload(
        args.requests, args.input, args.output, 0.0, model_vocab(path), args.seed).items]
    kw = dict(dtype="float32", max_model_len=args.input + args.output + 64,
              max_num_seqs=args.requests, max_num_batched_tokens=512)
    engines = {k: LLM(path, speculative_config=spec if k == "spec" else None, **kw)
               for k in ENGINES}
    profs = {}
    for k in ENGINES:
        warm_up(engines[k], prompts, args.seed + 99)
        profs[k] = instrument(engines[k])
    params = make_params("greedy", args.output, len(prompts), 0)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ENGINES}
    for rep in range(args.repeats):
        for k in (ENGINES if rep % 2 == 0 else ENGINES[::-1]):
            runs[k].append(run_once(engines[k], profs[k], prompts, params, len(prompts)))
        print(f"{case} repeat {rep + 1}/{args.repeats}", file=sys.stderr, flush=True)
    res = {k: pooled([summarize(r) for r in v]) for k, v in runs.items()}
    core = engines["spec"].engine
    return {"case": case, "speculative_config": spec, "runs": res,
            "agreement": agreement(runs),
            "recomputed_tokens": core.scheduler.spec_num_recomputed_tokens,
            "throughput_ratio": res["spec"]["out_tok_s"] / res["base"]["out_tok_s"]}


def table(results: list[dict[str, Any]]) -> str:
    head = ("| case | spec | out tok/s | TPOT median ms | steps | out tok / step | acceptance "
            "| mean acc. length | step kinds (steps x median ms) | identical |")
    rows = [head, "|" + "---|" * 10]
    for r in results:
        for k in ENGINES:
            s = r["runs"][k]
            kinds = ", ".join(f"{name} {v['steps']} x {v['median_ms']:.1f}"
                              for name, v in s["step_kinds"].items())
            acc = "-" if k == "base" or s["acceptance_rate"] is None else \
                f"{100 * s['acceptance_rate']:.1f}%"
            length = "-" if k == "base" or s["mean_acceptance_length"] is None else \
                f"{s['mean_acceptance_length']:.2f}"
            rows.append(f"| {r['case']} | {'off' if k == 'base' else 'on'} | "
                        f"{s['out_tok_s']:.1f} | {s['tpot_median_ms']:.2f} | {s['steps']} | "
                        f"{s['out_tokens_per_step']:.2f} | {acc} | {length} | {kinds} | "
                        f"{r['agreement']['identical']} |")
    rows.append("")
    rows += [f"- {r['case']}: throughput on / off {r['throughput_ratio']:.2f}x; tokens "
             f"computed again after rollbacks: {r['recomputed_tokens']}" for r in results]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = ap.add_argument
    a("--output-dir", default="benchmarks/results")
    a("--cases", default=",".join(CASES))
    a("--num-spec", type=int, default=2)
    a("--requests", type=int, default=8)
    a("--input", type=int, default=128)
    a("--output", type=int, default=128)
    a("--repeats", type=int, default=3)
    a("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    results = [run_case(c, args) for c in args.cases.split(",")]
    write_results(args.output_dir, "spec_decode_models", benchmark="spec_decode_models",
                  argv=sys.argv[1:] if argv is None else argv, config=vars(args),
                  results={"cases": results, "seconds": time.perf_counter() - t0},
                  table=table(results),
                  notes=["random weights: acceptance shows the mechanics, not what a trained "
                         "MTP layer or draft model accepts",
                         "llama+draft_model drafts with the target itself (acceptance 100% "
                         "for greedy: the upper bound of tokens per step)"],
                  agreement={r["case"]: r["agreement"] for r in results})
    return results


if __name__ == "__main__":
    main()
