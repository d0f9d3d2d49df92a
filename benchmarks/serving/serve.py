"""Online serving benchmark: a sweep of request rates against any OpenAI-compatible
server, with a table and a plot, in the results format of every benchmark here.

    python -m benchmarks.serving.serve --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --request-rate 8 --max-concurrency 64 --ignore-eos --result-json out.json
    python -m benchmarks.serving.serve --sweep 1,2,4,8,inf --plot sweep.png
    python -m benchmarks.serving.serve --sweep 1,2,4,inf --output-dir DIR   # serve.json/.md/.png

The JSON (--result-json, --output-dir) is the format of every benchmark here
(benchmarks/shared/results_io.py): the per-rate metrics and requests are under results.runs.

The client, the datasets and the metric definitions (those of `vllm bench serve`) are
the installed package's: jaxserve/bench/client.py, datasets.py and metrics.py, which
`jaxserve bench serve` (one run, vLLM's flags and JSON) is built on too.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from dataclasses import asdict, replace
from typing import Any

import numpy as np

if __package__ in (None, ""):   # run as a script (python benchmarks/serving/serve.py): the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.shared.results_io import (build_document, new_figure, try_plot, write_json,
                                          write_results)
from jaxserve.bench.client import (CHAT, COMPLETIONS, BenchConfig, RequestRecord, first_model,
                                   run_benchmark)
from jaxserve.bench.datasets import Prompt, random_dataset, sharegpt_dataset
from jaxserve.bench.metrics import aggregate, e2e, tpot, ttft
from jaxserve.bench.serve import parse_rate


# ----------------------------------------------------------------------------- reports

def format_summary(agg: dict[str, Any], rate: float) -> str:
    def num(x: float | None, nd: int = 2) -> str:
        return "n/a" if x is None else f"{x:.{nd}f}"

    rows = [("Request rate (req/s)", str(rate)),
            ("Successful requests", str(agg["completed"])), ("Failed requests", str(agg["failed"])),
            ("Benchmark duration (s)", num(agg["duration_s"])),
            ("Total input tokens", str(agg["total_input_tokens"])),
            ("Total generated tokens", str(agg["total_output_tokens"])),
            ("Request throughput (req/s)", num(agg["request_throughput"])),
            ("Output token throughput (tok/s)", num(agg["output_throughput"])),
            ("Total token throughput (tok/s)", num(agg["total_token_throughput"]))]
    lines = [" Serving benchmark ".center(56, "=")] + [f"{k:<42}{v:>14}" for k, v in rows]
    for key, title in (("ttft", "Time to first token"), ("tpot", "Time per output token"),
                       ("itl", "Inter-token latency"), ("e2el", "End-to-end latency")):
        lines.append(f" {title} ".center(56, "-"))
        lines += [f"{f'{st.capitalize()} {key.upper()} (ms)':<42}{num(agg[key][st + '_ms']):>14}"
                  for st in ("mean", "median", "p99", "std")]
    lines += [f"error: {err}" for err in agg["errors"][:3]]
    return "\n".join(lines + ["=" * 56])


def format_sweep_table(results: list[tuple[float, dict[str, Any]]]) -> str:
    """A Markdown table, one row per request rate."""
    head = ("| rate (req/s) | ok | failed | req/s | out tok/s | TTFT mean / p99 (ms) "
            "| TPOT mean / p99 (ms) | E2E mean / p99 (ms) |")
    lines = [head, "|" + "---|" * 8]

    def pair(d: dict[str, float | None]) -> str:
        return " / ".join("n/a" if d[k] is None else f"{d[k]:.1f}" for k in ("mean_ms", "p99_ms"))

    for rate, a in results:
        thr = ["n/a" if a[k] is None else f"{a[k]:.2f}"
               for k in ("request_throughput", "output_throughput")]
        lines.append(f"| {rate} | {a['completed']} | {a['failed']} | {thr[0]} | {thr[1]} "
                     f"| {pair(a['ttft'])} | {pair(a['tpot'])} | {pair(a['e2el'])} |")
    return "\n".join(lines)


def plot_sweep(results: list[tuple[float, dict[str, Any]]], path: str) -> None:
    plt, fig, axes = new_figure(3, width=5.0, height=4.2)
    xs = list(range(len(results)))   # categorical axis, so "inf" has a place
    panels = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E latency"))
    for ax, (key, title) in zip(axes, panels):
        for stat, style in (("mean_ms", "o-"), ("p99_ms", "s--")):
            ys = [np.nan if a[key][stat] is None else a[key][stat] for _, a in results]
            ax.plot(xs, ys, style, label=stat.split("_")[0])
        ax.set(title=title, xlabel="request rate (req/s)", ylabel="ms")
        ax.set_xticks(xs, [str(r) for r, _ in results])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def record_json(rec: RequestRecord) -> dict[str, Any]:
    return {**asdict(rec), "ttft": ttft(rec), "tpot": tpot(rec), "e2e": e2e(rec)}


# ----------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:8000")
    a("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT])
    a("--model", default=None, help="default: the first model of GET /v1/models")
    a("--dataset", default="random", choices=["random", "sharegpt"])
    a("--dataset-path", default=None, help="ShareGPT-format JSON file")
    a("--sharegpt-output-len", type=int, default=None, help="override max_tokens for ShareGPT")
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0)
    a("--random-vocab-size", type=int, default=256, help="token ids are drawn from [3, this)")
    a("--num-prompts", type=int, default=100)
    a("--request-rate", type=parse_rate, default=math.inf, help="req/s (Poisson) or inf")
    a("--max-concurrency", type=int, default=None)
    a("--seed", type=int, default=0)
    a("--ignore-eos", action="store_true")
    a("--temperature", type=float, default=0.0)
    a("--api-key", default=None)
    a("--timeout", type=float, default=600.0, help="seconds per request, whole stream")
    a("--result-json", default=None, help="the JSON alone (benchmarks.shared.results_io format)")
    a("--output-dir", default=None, help="write NAME.json, NAME.md and NAME.png here")
    a("--name", default="serve", help="file name stem in --output-dir")
    a("--sweep", default=None, help="comma-separated request rates, e.g. 1,2,4,inf")
    a("--plot", default=None,
      help="PNG written by --sweep (default serve_sweep.png unless --output-dir)")
    return p


def load_prompts(args: argparse.Namespace) -> list[Prompt]:
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path")
        return sharegpt_dataset(args.dataset_path, args.num_prompts, args.seed,
                                args.sharegpt_output_len)
    return random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                          args.random_range_ratio, args.seed, args.random_vocab_size,
                          text=args.endpoint == CHAT)


async def run_rates(cfg: BenchConfig, prompts: list[Prompt],
                    rates: list[float]) -> list[tuple[float, list[RequestRecord]]]:
    if cfg.model is None:   # ask once, not once per rate
        cfg = replace(cfg, model=await first_model(cfg))
    return [(rate, await run_benchmark(cfg, prompts, rate)) for rate in rates]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    cfg = BenchConfig(args.base_url.rstrip("/"), args.endpoint, args.model, args.max_concurrency,
                      args.seed, args.ignore_eos, args.temperature, args.api_key, args.timeout)
    rates = [parse_rate(r) for r in args.sweep.split(",")] if args.sweep else [args.request_rate]
    runs = asyncio.run(run_rates(cfg, load_prompts(args), rates))
    results = [(rate, aggregate(recs)) for rate, recs in runs]
    for rate, agg in results:
        print(format_summary(agg, rate))
    plot = args.plot or (None if args.output_dir else "serve_sweep.png")
    if args.sweep:
        print(format_sweep_table(results))
    config = {**vars(args), "request_rate": str(args.request_rate)}
    report = {"runs": [{"request_rate": str(rate), "metrics": agg,
                        "requests": [record_json(r) for r in recs]}
                       for (rate, agg), (_, recs) in zip(results, runs)]}
    note = ("machine: where this client ran; the server at "
            f"{args.base_url} may be elsewhere")
    if args.result_json:
        write_json(args.result_json, build_document(benchmark="serve", argv=argv, config=config,
                                                    results=report, notes=[note]))
    if args.output_dir:
        write_results(args.output_dir, args.name, benchmark="serve", argv=argv, config=config,
                      results=report, table=format_sweep_table(results),
                      plot=lambda path: plot_sweep(results, path), notes=[note])
    # last, after the results are written: without matplotlib only the figure is missing
    if args.sweep and plot and try_plot(lambda path: plot_sweep(results, path), plot):
        print(f"plot: {plot}")
    return report


if __name__ == "__main__":
    main()
