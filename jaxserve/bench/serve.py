"""`jaxserve bench serve`: load an OpenAI-compatible server (jaxserve's or vLLM's) and
report what `vllm bench serve` reports, under its flag names, printed lines and
`--save-result` JSON keys, so runs of either server compare with one command.

    jaxserve bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 1024 --random-output-len 128 --num-prompts 200 \\
        --request-rate 8 --max-concurrency 64 --ignore-eos --save-result

Metric definitions: jaxserve/bench/metrics.py; the client: jaxserve/bench/client.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from dataclasses import replace
from datetime import datetime
from typing import Any

from jaxserve.bench.client import CHAT, COMPLETIONS, BenchConfig, RequestRecord, first_model
from jaxserve.bench.client import run_benchmark, wait_ready
from jaxserve.bench.datasets import (Prompt, prefix_repetition_dataset, random_dataset,
                                     sharegpt_dataset)
from jaxserve.bench.metrics import METRICS, aggregate, itls, parse_goodput, pct_key, ttft

BACKENDS = {"openai": COMPLETIONS, "vllm": COMPLETIONS, "openai-chat": CHAT}
DATASETS = ("random", "sharegpt", "prefix_repetition")
_TITLES = {"ttft": ("Time to First Token", "TTFT"),
           "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
WIDTH = 50


def parse_rate(text: str) -> float:
    try:
        rate = float(text)   # accepts "inf"
    except ValueError:
        raise argparse.ArgumentTypeError(f"request rate must be a number or inf, got {text!r}")
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text}")
    return rate


def build_parser(prog: str = "jaxserve bench serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--backend", default="openai", choices=sorted(BACKENDS),
      help="openai / vllm: the completions endpoint; openai-chat: chat completions")
    a("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a("--endpoint", default=None, choices=[COMPLETIONS, CHAT],
      help="default: the backend's")
    a("--model", default=None, help="default: the first model of GET /v1/models")
    a("--tokenizer", default=None,
      help="tokenizer (directory or repo id) that counts ShareGPT tokens; default: the "
           "model's when it is a local directory, else characters / 4")
    a("--api-key", default=os.environ.get("OPENAI_API_KEY"),
      help="sent as a bearer token (default: $OPENAI_API_KEY)")
    a("--dataset-name", "--dataset", default="random", choices=DATASETS)
    a("--dataset-path", default=None, help="ShareGPT-format JSON file")
    a("--num-prompts", type=int, default=1000)
    a("--seed", type=int, default=0)
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0)
    a("--random-prefix-len", type=int, default=0, help="tokens every random prompt shares")
    a("--random-vocab-size", type=int, default=256,
      help="random token ids are drawn from [3, this)")
    a("--sharegpt-output-len", type=int, default=None, help="max_tokens for every ShareGPT prompt")
    a("--prefix-repetition-prefix-len", type=int, default=256)
    a("--prefix-repetition-suffix-len", type=int, default=256)
    a("--prefix-repetition-num-prefixes", type=int, default=10)
    a("--prefix-repetition-output-len", type=int, default=128)
    a("--request-rate", type=parse_rate, default=math.inf,
      help="requests per second, or inf (all at once)")
    a("--burstiness", type=float, default=1.0,
      help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 more even")
    a("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    a("--ignore-eos", action="store_true", help="send ignore_eos: every request runs to max_tokens")
    a("--temperature", type=float, default=0.0)
    a("--top-p", type=float, default=None)
    a("--top-k", type=int, default=None)
    a("--min-p", type=float, default=None)
    a("--percentile-metrics", default="ttft,tpot,itl",
      help="comma-separated, of " + ",".join(METRICS))
    a("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    a("--goodput", nargs="+", default=None, metavar="METRIC:MS",
      help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000")
    a("--ready-check-timeout-sec", type=float, default=600.0,
      help="wait this long for GET /health to answer 200 first (0: do not wait)")
    a("--timeout", type=float, default=600.0, help="seconds per request, whole stream")
    a("--disable-tqdm", action="store_true", help="no progress bar")
    a("--save-result", action="store_true", help="write the result JSON")
    a("--save-detailed", action="store_true",
      help="with --save-result: also each request's lengths, TTFT, ITLs, text and error")
    a("--result-dir", default=None, help="where --save-result writes (default: here)")
    a("--result-filename", default=None,
      help="default: BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json")
    a("--label", default=None, help="names the run in the JSON and the default file name")
    a("--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="added to the JSON")
    return p


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def checked(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The flags' values checked together; errors exit 2 naming the flag."""
    bad = [m for m in _csv(args.percentile_metrics) if m not in METRICS]
    if bad or not _csv(args.percentile_metrics):
        p.error(f"--percentile-metrics: {bad or args.percentile_metrics!r} not in "
                f"{','.join(METRICS)}")
    try:
        args.percentiles = [float(x) for x in _csv(args.metric_percentiles)]
    except ValueError:
        p.error(f"--metric-percentiles: not numbers: {args.metric_percentiles!r}")
    if not args.percentiles or not all(0 < x <= 100 for x in args.percentiles):
        p.error(f"--metric-percentiles: each must be in (0, 100], got {args.metric_percentiles!r}")
    try:
        args.slos = parse_goodput(args.goodput or [])
    except ValueError as e:
        p.error(f"--goodput: {e}")
    for kv in args.metadata:
        if "=" not in kv:
            p.error(f"--metadata: {kv!r} is not KEY=VALUE")
    if args.num_prompts < 1:
        p.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.burstiness > 0:
        p.error(f"--burstiness must be > 0, got {args.burstiness}")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        p.error("--dataset-name sharegpt needs --dataset-path")
    if args.dataset_path and args.dataset_name != "sharegpt":
        p.error(f"--dataset-path is read by --dataset-name sharegpt, not {args.dataset_name}")
    if args.save_detailed and not args.save_result:
        p.error("--save-detailed needs --save-result")
    args.endpoint = args.endpoint or BACKENDS[args.backend]
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return args


def _encoder(args: argparse.Namespace):
    """The tokenizer's encode for ShareGPT lengths, or None (characters / 4)."""
    name = args.tokenizer or (args.model if args.model and os.path.isdir(args.model) else None)
    if name is None:
        return None
    from transformers import AutoTokenizer   # (~2 s to import: only with a tokenizer)
    tok = AutoTokenizer.from_pretrained(name)
    return lambda text: tok.encode(text, add_special_tokens=False)


def load_prompts(args: argparse.Namespace) -> list[Prompt]:
    text = args.endpoint == CHAT
    if args.dataset_name == "sharegpt":
        return sharegpt_dataset(args.dataset_path, args.num_prompts, args.seed,
                                args.sharegpt_output_len, _encoder(args))
    if args.dataset_name == "prefix_repetition":
        return prefix_repetition_dataset(
            args.num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len, args.seed, args.random_vocab_size, text)
    return random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                          args.random_range_ratio, args.seed, args.random_vocab_size, text,
                          args.random_prefix_len)


def format_result(agg: dict[str, Any], args: argparse.Namespace) -> str:
    def row(label: str, value: Any) -> str:
        if value is None:
            value = "n/a"
        elif isinstance(value, float):
            value = f"{value:.2f}"
        return f"{label:<40} {value}"

    lines = [" Serving Benchmark Result ".center(WIDTH, "="),
             row("Successful requests:", agg["completed"]),
             row("Failed requests:", agg["failed"])]
    if args.max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", args.max_concurrency))
    lines += [row("Request rate configured (RPS):", args.request_rate),
              row("Benchmark duration (s):", agg["duration_s"]),
              row("Total input tokens:", agg["total_input_tokens"]),
              row("Total generated tokens:", agg["total_output_tokens"]),
              row("Request throughput (req/s):", agg["request_throughput"])]
    if args.slos:
        lines.append(row("Request goodput (req/s):", agg["request_goodput"]))
    lines += [row("Output token throughput (tok/s):", agg["output_throughput"]),
              row("Peak output token throughput (tok/s):", float(agg["max_output_tokens_per_s"])),
              row("Peak concurrent requests:", float(agg["max_concurrent_requests"])),
              row("Total Token throughput (tok/s):", agg["total_token_throughput"])]
    for metric in _csv(args.percentile_metrics):
        title, short = _TITLES[metric]
        stats = agg[metric]
        lines.append(f" {title} ".center(WIDTH, "-"))
        lines += [row(f"Mean {short} (ms):", stats["mean_ms"]),
                  row(f"Median {short} (ms):", stats["median_ms"])]
        lines += [row(f"P{p:g} {short} (ms):", stats[pct_key(p)]) for p in args.percentiles]
    lines += [f"error: {err}" for err in agg["errors"][:3]]
    return "\n".join(lines + ["=" * WIDTH])


def result_json(agg: dict[str, Any], records: list[RequestRecord], args: argparse.Namespace,
                model: str, date: str) -> dict[str, Any]:
    """vLLM's --save-result keys: the run's settings, totals, and for each metric of
    --percentile-metrics mean/median/std/p<N>_<metric>_ms."""
    out: dict[str, Any] = {
        "date": date, "endpoint_type": args.backend, "label": args.label, "model_id": model,
        "tokenizer_id": args.tokenizer or model, "num_prompts": args.num_prompts,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "duration": agg["duration_s"]}
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests"):
        out[key] = agg[key]
    for metric in _csv(args.percentile_metrics):
        for stat, value in agg[metric].items():   # "p99_ms" -> "p99_ttft_ms"
            out[f"{stat[:-3]}_{metric}_ms"] = value
    if args.save_detailed:
        out.update(input_lens=[r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len
                               for r in records],
                   output_lens=[r.output_tokens for r in records],
                   ttfts=[ttft(r) for r in records], itls=[itls(r) for r in records],
                   generated_texts=[r.text for r in records], errors=[r.error for r in records])
    out.update(kv.split("=", 1) for kv in args.metadata)
    return out


def result_path(args: argparse.Namespace, model: str, now: datetime) -> str:
    if args.result_filename:
        name = args.result_filename
    else:
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        base = os.path.basename(model.rstrip("/")) or "model"
        name = (f"{args.label or args.backend}-{rate}qps{conc}-{base}-"
                f"{now.strftime('%Y%m%d-%H%M%S')}.json")
    return os.path.join(args.result_dir, name) if args.result_dir else name


async def _run(args: argparse.Namespace, prompts: list[Prompt]):
    cfg = BenchConfig(args.base_url, args.endpoint, args.model, args.max_concurrency, args.seed,
                      args.ignore_eos, args.temperature, args.api_key, args.timeout,
                      args.burstiness,
                      {k: v for k, v in (("top_p", args.top_p), ("top_k", args.top_k),
                                         ("min_p", args.min_p)) if v is not None})
    if args.ready_check_timeout_sec > 0:
        await wait_ready(cfg, args.ready_check_timeout_sec)
    if cfg.model is None:
        cfg = replace(cfg, model=await first_model(cfg))
    bar = None
    if not args.disable_tqdm:
        from tqdm.auto import tqdm   # (only when the progress bar is shown)
        bar = tqdm(total=len(prompts), desc="requests", file=sys.stderr)
    try:
        records = await run_benchmark(cfg, prompts, args.request_rate,
                                      on_done=bar.update if bar else None)
    finally:
        if bar is not None:
            bar.close()
    return cfg.model, records


def main(argv: list[str] | None = None, prog: str = "jaxserve bench serve") -> dict[str, Any]:
    p = build_parser(prog)
    args = checked(p, p.parse_args(argv))
    try:
        prompts = load_prompts(args)
    except (ValueError, OSError) as e:
        p.error(str(e))
    now = datetime.now()
    model, records = asyncio.run(_run(args, prompts))
    agg = aggregate(records, args.percentiles, args.slos or None)
    print(format_result(agg, args))
    result = result_json(agg, records, args, model, now.strftime("%Y%m%d-%H%M%S"))
    if args.save_result:
        path = result_path(args, model, now)
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"result: {path}")
    return result
