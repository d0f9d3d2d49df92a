"""`jaxserve bench latency`: the time of one batch, end to end, as `vllm bench latency`
measures it (its flags, printed lines and --output-json keys): `--batch-size` random
prompts of `--input-len` tokens, each generating exactly `--output-len` tokens, given
to one LLM.generate; `--num-iters-warmup` untimed runs, then `--num-iters` timed ones.
The prefix cache is reset before each run, so no run reuses another's prompt pages.

    jaxserve bench latency --model DIR --input-len 32 --output-len 128 --batch-size 8
"""
from __future__ import annotations

import argparse
import random
from typing import Any

import numpy as np

from jaxserve.bench import offline
from jaxserve.bench.datasets import Prompt, random_ids

PERCENTILES = (10, 25, 50, 75, 90, 99)


def build_parser(prog: str = "jaxserve bench latency") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--input-len", type=int, default=32)
    a("--output-len", type=int, default=128)
    a("--batch-size", type=int, default=8)
    a("--num-iters-warmup", type=int, default=10)
    a("--num-iters", type=int, default=30)
    offline.add_offline_args(p)
    return p


def parse(argv: list[str] | None, prog: str = "jaxserve bench latency") -> argparse.Namespace:
    p = build_parser(prog)
    args = p.parse_args(argv)
    offline.check_offline(p, args)
    for flag, least in (("input_len", 1), ("output_len", 1), ("batch_size", 1),
                        ("num_iters_warmup", 0), ("num_iters", 1)):
        if getattr(args, flag) < least:
            p.error(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    return args


def run(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed or 0)
    vocab = llm.engine.inputs.vocab_size
    batch = [Prompt(random_ids(rng, args.input_len, vocab), args.input_len, args.output_len)
             for _ in range(args.batch_size)]
    detok = not args.disable_detokenize

    def once() -> float:
        llm.reset_prefix_cache()
        return offline.generate(llm, batch, args.n, detok)[0]

    for _ in range(args.num_iters_warmup):
        once()
    before = llm.engine.num_compilations
    latencies = [once() for _ in range(args.num_iters)]
    return {"avg_latency": float(np.mean(latencies)), "latencies": latencies,
            "percentiles": {str(p): float(np.percentile(latencies, p)) for p in PERCENTILES},
            "compilations_during_run": llm.engine.num_compilations - before}


def report(res: dict[str, Any]) -> str:
    lines = [f"Avg latency: {res['avg_latency']} seconds"]
    lines += [f"{p}% percentile latency: {v} seconds" for p, v in res["percentiles"].items()]
    lines.append(f"Compilations during the timed runs: {res['compilations_during_run']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "jaxserve bench latency",
         llm: Any = None) -> dict[str, Any]:
    """llm: an engine already built from these flags (tests share one)."""
    return offline.run_command(parse(argv, prog), llm, run, report)
