"""jaxserve.bench's pieces that need no server: the datasets `jaxserve bench` adds to
the ones benchmarks/serving/serve.py had (a shared random prefix, prefix repetition, bursty
arrivals), goodput, peak concurrency, vLLM's result keys and file name, and the
`jaxserve bench` command's dispatch."""
from __future__ import annotations

import argparse
import math
import subprocess
import sys
from datetime import datetime

import numpy as np
import pytest

from jaxserve.bench import serve
from jaxserve.bench.client import RequestRecord
from jaxserve.bench.datasets import arrival_times, prefix_repetition_dataset, random_dataset
from jaxserve.bench.metrics import aggregate, parse_goodput, peak_concurrency


def rec(send: float, chunks: list[float], end: float, out: int) -> RequestRecord:
    return RequestRecord(prompt_len=4, max_tokens=out, send=send, end=end, chunk_times=chunks,
                         output_tokens=out, prompt_tokens=4, success=True)


def test_random_prefix_is_shared_and_counted():
    ps = random_dataset(5, 6, 2, 0.0, seed=3, vocab_size=50, prefix_len=10)
    assert all(p.prompt[:10] == ps[0].prompt[:10] and len(p.prompt) == p.prompt_len == 16
               for p in ps)
    assert len({tuple(p.prompt[10:]) for p in ps}) == 5
    words = random_dataset(3, 4, 2, 0.0, seed=3, text=True, prefix_len=5)
    assert all(p.prompt.split()[:5] == words[0].prompt.split()[:5] for p in words)


def test_prefix_repetition():
    ps = prefix_repetition_dataset(12, prefix_len=8, suffix_len=3, num_prefixes=3,
                                   output_len=5, seed=1, vocab_size=40)
    assert ps == prefix_repetition_dataset(12, 8, 3, 3, 5, seed=1, vocab_size=40)
    prefixes = [tuple(p.prompt[:8]) for p in ps]
    assert len(set(prefixes)) == 3 and all(prefixes.count(x) == 4 for x in set(prefixes))
    assert all(len(p.prompt) == p.prompt_len == 11 and p.output_len == 5 for p in ps)
    with pytest.raises(ValueError, match="num prefixes"):
        prefix_repetition_dataset(2, 8, 3, 0, 5, seed=1)


def test_burstiness_keeps_the_rate_and_changes_the_spread():
    even, poisson, bursty = (np.diff(arrival_times(20_000, 4.0, seed=2, burstiness=b))
                             for b in (4.0, 1.0, 0.25))
    for gaps in (even, poisson, bursty):
        assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    # gamma(k): coefficient of variation 1/sqrt(k)
    assert even.std() / even.mean() == pytest.approx(0.5, rel=0.05)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, seed=0, burstiness=0.0)


def test_goodput_peaks_and_percentiles():
    recs = [rec(0.0, [0.1, 0.2, 0.3], 0.3, 3),    # ttft 100 ms, tpot 100 ms
            rec(0.0, [0.6, 0.7], 0.7, 2),         # ttft 600 ms
            rec(1.5, [1.6, 1.7, 1.8], 2.0, 3)]    # e2el 500 ms, not overlapping the others
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 0.5, "e2el": 2.0}
    a = aggregate(recs, percentiles=(50, 90), goodput=parse_goodput(["ttft:500"]))
    assert a["request_goodput"] == pytest.approx(2 / 2.0)   # two met the SLO, in 2 s
    assert a["max_concurrent_requests"] == 2 and peak_concurrency([]) == 0
    assert a["max_output_tokens_per_s"] == 5   # chunks in second [0, 1)
    assert a["ttft"]["p50_ms"] == pytest.approx(100.0) and "p99_ms" not in a["ttft"]
    assert aggregate(recs)["request_goodput"] is None
    for bad in ("itl:5", "ttft", "ttft:abc", "ttft:-1"):
        with pytest.raises(ValueError):
            parse_goodput([bad])


def test_result_keys_and_default_file_name():
    args = serve.checked(serve.build_parser(), serve.build_parser().parse_args(
        ["--percentile-metrics", "ttft,e2el", "--metric-percentiles", "90,99.9",
         "--request-rate", "2.5", "--max-concurrency", "8", "--save-result",
         "--metadata", "gpu=h100", "--label", "mine"]))
    recs = [rec(0.0, [0.1, 0.2], 0.3, 2)]
    doc = serve.result_json(aggregate(recs, args.percentiles), recs, args, "org/My-Model", "d")
    assert {"mean_ttft_ms", "median_e2el_ms", "std_ttft_ms", "p90_ttft_ms",
            "p99.9_e2el_ms"} <= set(doc)
    assert "mean_tpot_ms" not in doc and "ttfts" not in doc and doc["gpu"] == "h100"
    assert (doc["request_rate"], doc["max_concurrency"], doc["completed"]) == (2.5, 8, 1)
    when = datetime(2026, 1, 2, 3, 4, 5)
    assert serve.result_path(args, "org/My-Model", when) == \
        "mine-2.5qps-concurrency8-My-Model-20260102-030405.json"
    text = serve.format_result(aggregate(recs, args.percentiles), args)
    assert "P99.9 E2EL (ms):" in text and "TPOT" not in text
    inf = argparse.Namespace(**{**vars(args), "request_rate": math.inf, "max_concurrency": None,
                                "label": None, "result_dir": "out"})
    assert serve.result_path(inf, "m", when).startswith("out/openai-infqps-m-")


def test_the_bench_command_dispatches():
    run = [sys.executable, "-m", "jaxserve.console", "bench"]
    usage = subprocess.run([*run, "--help"], capture_output=True, text=True)
    assert usage.returncode == 0
    assert all(name in usage.stdout for name in ("serve", "throughput", "latency"))
    bad = subprocess.run([*run, "servee"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown benchmark 'servee'" in bad.stderr
    helps = subprocess.run([*run, "serve", "--help"], capture_output=True, text=True)
    assert helps.returncode == 0 and helps.stdout.startswith("usage: jaxserve bench serve")
