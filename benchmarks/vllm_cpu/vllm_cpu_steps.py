"""Where jaxserve's side of the offline comparison spends its time, and how much of it is
attention: every engine step timed, the steps that carry prefill chunks apart from the
decode-only steps, in two variants run alternately in fresh processes:

  full            the engine as it serves;
  no_attention    the same engine with the CPU attention kernel (paged_loop.py) replaced by
                  its queries: what every step would cost if attention were free. Its
                  tokens are garbage; only its times mean something.

    python -m benchmarks.vllm_cpu.vllm_cpu_steps --model DIR --workload FILE [--dtype bfloat16]
    python -m benchmarks.vllm_cpu.vllm_cpu_steps --model DIR --num-prompts 48 --input-len 200 \\
        --output-len 96

FILE is a workload written by vllm_cpu.py (`workload-llama.json` in its work folder); without
it a random one is made (vllm_cpu.py's generator, same seed). The engine settings default to
the offline comparison's (vllm_cpu_run.py). XLA:CPU only: other platforms run other kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

VARIANTS = ("full", "no_attention")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--workload", default=None, help="vllm_cpu.py's workload JSON")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1, help="runs of each variant, alternating")
    p.add_argument("--output", default=None, help="JSON of every run and the summary")
    p.add_argument("--worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-output", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def load_items(args: argparse.Namespace) -> list:
    from benchmarks.shared.common import Item
    if args.workload:
        from benchmarks.vllm_cpu.vllm_cpu_workload import read_workload
        return [Item(it["prompt_token_ids"], it["max_tokens"]) for it in read_workload(args.workload)]
    from benchmarks.shared.workloads import random_workload
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    return random_workload(args.num_prompts, args.input_len, args.output_len, 0.0, vocab,
                           args.seed).items


def without_attention() -> None:
    """Every paged attention call of the XLA:CPU path returns its queries (same shape and
    dtype): the step keeps its other work, attention costs nothing. Before the engine
    traces its programs (their HLO differs, so the compilation cache keeps them apart)."""
    from pallas_kernels.ragged_paged_attention import paged_loop
    paged_loop.ragged_paged_attention = lambda q, *args, **kwargs: q


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this process: warm the engine up, then time the workload's steps."""
    if args.worker == "no_attention":
        without_attention()
    from benchmarks.shared.jaxserve_offline import generate, make_llm
    from benchmarks.step.step_times import time_steps
    items = load_items(args)
    llm, startup = make_llm(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                            max_num_seqs=args.max_num_seqs, seed=args.seed,
                            max_num_batched_tokens=args.max_num_batched_tokens)
    generate(llm, items[:2], progress=False)
    llm.reset_prefix_cache()
    t = time_steps(llm)
    compiles = llm.engine.num_compilations
    t0 = time.perf_counter()
    outputs = generate(llm, items, progress=False)
    seconds = time.perf_counter() - t0
    steps = [d + c for d, c in zip(t["dispatch"], t["collect"])]
    # a decode-only step has one token a row; more carry a prefill chunk
    carries = [n > r for n, r in zip(t["tokens"], t["rows"])]
    prefill = [s for s, p in zip(steps, carries) if p]
    decode = [s for s, p in zip(steps, carries) if not p]
    return {"variant": args.worker, "seconds": seconds, "startup_s": startup,
            "output_tok_s": sum(map(len, outputs)) / seconds, "steps": len(steps),
            "prefill_steps": len(prefill), "prefill_s": sum(prefill),
            "decode_steps": len(decode), "decode_s": sum(decode),
            "decode_median_ms": 1e3 * statistics.median(decode) if decode else None,
            "outside_steps_s": seconds - sum(steps),
            "compilations_during_run": llm.engine.num_compilations - compiles,
            "first_tokens": outputs[0][:16]}


def worker_command(args: argparse.Namespace, variant: str, out: str) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.vllm_cpu.vllm_cpu_steps", "--worker", variant,
           "--worker-output", out, "--model", args.model, "--dtype", args.dtype,
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--seed", str(args.seed),
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return cmd + (["--workload", args.workload] if args.workload else [])


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per variant and the share of each phase that attention takes (1 - the
    attention-free time over the full one)."""
    med = {v: {k: statistics.median(r[k] for r in runs if r["variant"] == v)
               for k in ("seconds", "output_tok_s", "prefill_s", "decode_s")}
           for v in VARIANTS if any(r["variant"] == v for r in runs)}
    out: dict[str, Any] = {"medians": med}
    if len(med) == 2:
        full, free = med["full"], med["no_attention"]
        out["attention_share"] = {k: (1 - free[k] / full[k]) if full[k] else None
                                  for k in ("seconds", "prefill_s", "decode_s")}
    return out


def table(runs: list[dict[str, Any]], summ: dict[str, Any]) -> str:
    lines = ["| variant | out tok/s | seconds | prefill steps (s) | decode steps (s) | "
             "decode median ms | compilations |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['variant']} | {r['output_tok_s']:.1f} | {r['seconds']:.2f} | "
                     f"{r['prefill_steps']} ({r['prefill_s']:.2f}) | {r['decode_steps']} "
                     f"({r['decode_s']:.2f}) | {r['decode_median_ms'] or 0:.1f} | "
                     f"{r['compilations_during_run']} |")
    share = summ.get("attention_share")
    if share:
        lines.append("")
        lines.append("attention's share (1 - attention-free / full, medians): "
                     + ", ".join(f"{k} {100 * v:.0f} %" for k, v in share.items()
                                 if v is not None))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        res = worker(args)
        with open(args.worker_output, "w", encoding="utf-8") as f:
            json.dump(res, f)
        return 0
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: must be >= 1")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for variant in VARIANTS:
                out = os.path.join(tmp, f"{variant}-{rep}.json")
                print(f"[{rep + 1}/{args.repeats}] {variant}", file=sys.stderr, flush=True)
                subprocess.run(worker_command(args, variant, out), check=True)
                with open(out, encoding="utf-8") as f:
                    runs.append(json.load(f))
    summ = summary(runs)
    print(table(runs, summ))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith("worker")},
                       "runs": runs, "summary": summ}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
