"""Online serving benchmark: a load generator for any OpenAI-compatible server.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --request-rate 8 --max-concurrency 64 --ignore-eos --result-json out.json
    python benchmarks/serve.py --sweep 1,2,4,8,inf --plot sweep.png
    python -m benchmarks.serve --sweep 1,2,4,inf --output-dir DIR   # serve.json/.md/.png

The JSON (--result-json, --output-dir) is the format of every benchmark here
(benchmarks/results_io.py): the per-rate metrics and requests are under results.runs.

Every request streams (``stream: true`` with ``stream_options.include_usage``) and
its client-side timestamps are kept: send, every *content* chunk (an SSE event
whose choice carries non-empty text, chat delta content or token ids; role-only
and usage-only events are not content), and end (arrival of ``data: [DONE]``).
The numbers follow the definitions used by ``vllm bench serve``, so they compare
with published ones:

* TTFT, time to first token: first content chunk minus send. "Send" is when the
  request leaves the client, after any wait for a ``--max-concurrency`` slot, so
  client-side queueing is not counted; server-side queueing is.
* E2E latency: end minus send.
* TPOT, time per output token, one value per request that produced more than one
  token: (E2E - TTFT) / (output_tokens - 1), the mean decode step after the first
  token as seen by that request. Requests are weighted equally, not tokens.
* ITL, inter-token latency: the gaps between consecutive content chunks, pooled
  over all requests. A server that packs several tokens into one chunk yields one
  (larger) gap for them, so ITL is per chunk while TPOT is per token.
* For each of the four: mean, median, 99th percentile (linear interpolation) and
  population standard deviation, in milliseconds, over successful requests.
* Output tokens of a request: ``completion_tokens`` of the final usage event; if
  the server sends no usage, the number of content chunks. Prompt tokens: usage
  ``prompt_tokens``, else the dataset's estimate.
* Duration: earliest send to latest end, over all requests. Request throughput =
  successful requests / duration; output token throughput = output tokens of
  successful requests / duration; total token throughput = (prompt + output
  tokens of successful requests) / duration.

A request fails on a non-200 status, an ``error`` event, a stream that ends
without ``[DONE]``, a transport error or ``--timeout`` (whole request). Arrivals
are a Poisson process (exponential gaps from ``--seed``) or all at once for
``--request-rate inf``. The client only ever connects to ``--base-url`` (proxy
environment variables are ignored).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import httpx
import numpy as np

if __package__ in (None, ""):   # run as a script (python benchmarks/serve.py): the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.results_io import (build_document, new_figure, try_plot, write_json,
                                   write_results)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work number night point home water room mother area money story fact "
         "month lot right study book eye job word business issue side kind head house").split()


@dataclass(frozen=True)
class Prompt:
    prompt: str | list[int]   # text, or token ids (completions endpoint only)
    prompt_len: int           # estimated prompt tokens, used when the server sends no usage
    output_len: int           # sent as max_tokens


@dataclass
class RequestRecord:
    """What the client saw for one request; times are seconds since the run began."""
    prompt_len: int
    max_tokens: int
    send: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None   # from usage
    usage_completion_tokens: int | None = None
    success: bool = False
    error: str = ""


# ----------------------------------------------------------------------------- datasets

def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   seed: int, vocab_size: int = 256, text: bool = False) -> list[Prompt]:
    """Lengths uniform in [len*(1-r), len*(1+r)]; token ids in [3, vocab) or words (text)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"random lengths must be >= 1, got {input_len} and {output_len}")
    rng, r = random.Random(seed), range_ratio

    def length(n: int) -> int:
        return max(1, rng.randint(math.floor(n * (1 - r)), math.ceil(n * (1 + r))))

    out = []
    for _ in range(num_prompts):
        n_in, n_out = length(input_len), length(output_len)
        if text:   # chat takes text; about one token per common word
            out.append(Prompt(" ".join(rng.choice(WORDS) for _ in range(n_in)), n_in, n_out))
        else:
            out.append(Prompt([rng.randrange(3, vocab_size) for _ in range(n_in)], n_in, n_out))
    return out


def approx_tokens(text: str) -> int:
    """Token estimate without a tokenizer: characters / 4, rounded up, at least 1."""
    return max(1, (len(text) + 3) // 4)


def sharegpt_dataset(path: str, num_prompts: int, seed: int,
                     output_len: int | None = None) -> list[Prompt]:
    """First human turn as prompt; first gpt turn after it sets max_tokens (chars / 4)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = []
    for conv in data:
        turns = conv.get("conversations", []) if isinstance(conv, dict) else []
        human = next((i for i, t in enumerate(turns) if t.get("from") in ("human", "user")), None)
        if human is None:
            continue
        reply = next((t for t in turns[human + 1:] if t.get("from") in ("gpt", "assistant")), None)
        if reply is None or not turns[human].get("value") or not reply.get("value"):
            continue
        text = turns[human]["value"]
        pairs.append(Prompt(text, approx_tokens(text), output_len or approx_tokens(reply["value"])))
    if len(pairs) < num_prompts:
        raise ValueError(f"{path} has {len(pairs)} usable conversations, need {num_prompts}")
    random.Random(seed).shuffle(pairs)
    return pairs[:num_prompts]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Offsets (s) of n arrivals: a Poisson process of `rate` req/s, first at 0; inf -> all 0."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 or inf, got {rate}")
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


# ----------------------------------------------------------------------------- one request

def build_payload(endpoint: str, model: str, p: Prompt, ignore_eos: bool,
                  temperature: float) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": p.output_len, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == CHAT:
        if not isinstance(p.prompt, str):
            raise ValueError("the chat endpoint needs text prompts, got token ids")
        body["messages"] = [{"role": "user", "content": p.prompt}]
    elif endpoint == COMPLETIONS:
        body["prompt"] = p.prompt
    else:
        raise ValueError(f"endpoint must be {COMPLETIONS} or {CHAT}, got {endpoint!r}")
    if ignore_eos:
        body["ignore_eos"] = True   # vLLM-style extra field
    return body


def has_content(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or choice.get("token_ids") or delta.get("content") \
                or delta.get("reasoning_content"):
            return True
    return False


def feed_line(rec: RequestRecord, line: str, now: float) -> bool:
    """Apply one SSE line to the record; True when it is ``data: [DONE]``."""
    if not line.startswith("data:"):
        return False   # blank separators, ": comments", other SSE fields
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    event = json.loads(data)
    if event.get("error"):
        raise RuntimeError(f"error event: {json.dumps(event['error'])[:300]}")
    if has_content(event):
        rec.chunk_times.append(now)
    usage = event.get("usage")
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.usage_completion_tokens = usage.get("completion_tokens")
    return False


async def send_request(client: httpx.AsyncClient, endpoint: str, payload: dict[str, Any],
                       rec: RequestRecord, timeout: float, clock: Callable[[], float]) -> None:
    rec.send = clock()
    done_at: float | None = None
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", endpoint, json=payload) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    raise RuntimeError(f"HTTP {resp.status_code}: {body[:300]}")
                async for line in resp.aiter_lines():   # drain so the connection is reused
                    if done_at is None and feed_line(rec, line, clock()):
                        done_at = clock()
        if done_at is None:
            raise RuntimeError("stream ended without data: [DONE]")
    except TimeoutError:
        rec.error = f"timeout after {timeout} s"
    except Exception as e:   # one bad request must not end the run
        rec.error = f"{type(e).__name__}: {e}"
    if done_at is not None:   # complete, even if draining the tail failed
        rec.end, rec.success, rec.error = done_at, True, ""
    else:
        rec.end = clock()
    rec.output_tokens = (rec.usage_completion_tokens if rec.usage_completion_tokens is not None
                         else len(rec.chunk_times))


# ----------------------------------------------------------------------------- metrics

def ttft(rec: RequestRecord) -> float | None:
    return rec.chunk_times[0] - rec.send if rec.chunk_times else None


def e2e(rec: RequestRecord) -> float:
    return rec.end - rec.send


def tpot(rec: RequestRecord) -> float | None:
    first = ttft(rec)
    if first is None or rec.output_tokens <= 1:
        return None
    return (e2e(rec) - first) / (rec.output_tokens - 1)


def itls(rec: RequestRecord) -> list[float]:
    return [b - a for a, b in zip(rec.chunk_times, rec.chunk_times[1:])]


def summarize(values: list[float]) -> dict[str, float | None]:
    """mean / median / p99 / std in milliseconds (None when there are no values)."""
    if not values:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None, "std_ms": None}
    ms = np.asarray(values, dtype=np.float64) * 1e3
    return {"mean_ms": float(ms.mean()), "median_ms": float(np.median(ms)),
            "p99_ms": float(np.percentile(ms, 99)), "std_ms": float(ms.std())}


def aggregate(records: list[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    duration = (max(r.end for r in records) - min(r.send for r in records)) if records else 0.0
    prompt_toks = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    output_toks = sum(r.output_tokens for r in ok)

    def per_s(x: float) -> float | None:
        return x / duration if duration > 0 else None

    firsts = [t for t in map(ttft, ok) if t is not None]
    decodes = [t for t in map(tpot, ok) if t is not None]
    return {"completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
            "total_input_tokens": prompt_toks, "total_output_tokens": output_toks,
            "request_throughput": per_s(len(ok)), "output_throughput": per_s(output_toks),
            "total_token_throughput": per_s(prompt_toks + output_toks),
            "ttft": summarize(firsts), "tpot": summarize(decodes),
            "itl": summarize([g for r in ok for g in itls(r)]),
            "e2e": summarize([e2e(r) for r in ok]),
            "errors": [r.error for r in records if not r.success][:5]}


# ----------------------------------------------------------------------------- runner

@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = COMPLETIONS
    model: str | None = None
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    api_key: str | None = None
    timeout: float = 600.0


def make_client(cfg: BenchConfig, pool: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.AsyncClient(
        base_url=cfg.base_url, headers=headers, http1=True, http2=False, trust_env=False,
        limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
        timeout=httpx.Timeout(cfg.timeout, pool=None))


async def first_model(cfg: BenchConfig) -> str:
    async with make_client(cfg, 1) as client:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{cfg.base_url}/v1/models lists no models")
    return models[0]["id"]


async def run_benchmark(cfg: BenchConfig, prompts: list[Prompt],
                        rate: float) -> list[RequestRecord]:
    """Send every prompt once (Poisson arrivals at `rate`); records in prompt order."""
    model = cfg.model or await first_model(cfg)
    payloads = [build_payload(cfg.endpoint, model, p, cfg.ignore_eos, cfg.temperature)
                for p in prompts]
    offsets = arrival_times(len(prompts), rate, cfg.seed)
    slots = cfg.max_concurrency or max(1, len(prompts))
    gate = asyncio.Semaphore(slots)
    records = [RequestRecord(p.prompt_len, p.output_len) for p in prompts]
    async with make_client(cfg, slots) as client:
        t0 = time.perf_counter()   # after the client exists: building it takes ~30 ms

        def clock() -> float:
            return time.perf_counter() - t0

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, offsets[i] - clock()))
            async with gate:
                await send_request(client, cfg.endpoint, payloads[i], records[i], cfg.timeout,
                                   clock)
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return records


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
                       ("itl", "Inter-token latency"), ("e2e", "End-to-end latency")):
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
                     f"| {pair(a['ttft'])} | {pair(a['tpot'])} | {pair(a['e2e'])} |")
    return "\n".join(lines)


def plot_sweep(results: list[tuple[float, dict[str, Any]]], path: str) -> None:
    plt, fig, axes = new_figure(3, width=5.0, height=4.2)
    xs = list(range(len(results)))   # categorical axis, so "inf" has a place
    for ax, (key, title) in zip(axes, (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E latency"))):
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

def parse_rate(text: str) -> float:
    rate = float(text)   # accepts "inf"
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text}")
    return rate


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
    a("--result-json", default=None, help="the JSON alone (benchmarks.results_io format)")
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
        cfg = BenchConfig(**{**asdict(cfg), "model": await first_model(cfg)})
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
