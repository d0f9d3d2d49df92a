"""Serving metrics from the client's timestamps, as `vllm bench serve` defines them, so
the numbers compare with published ones:

* TTFT, time to first token: first content chunk minus send.
* E2E latency (e2el): end minus send.
* TPOT, time per output token, one value per request that produced more than one
  token: (E2E - TTFT) / (output_tokens - 1), the mean decode step after the first
  token as that request saw it. Requests are weighted equally, not tokens.
* ITL, inter-token latency: the gaps between consecutive content chunks, pooled over
  all requests. A server that packs several tokens into one chunk yields one (larger)
  gap for them, so ITL is per chunk while TPOT is per token.
* For each: mean, median, standard deviation (population) and the asked percentiles
  (linear interpolation), in milliseconds, over successful requests.
* Output tokens of a request: ``completion_tokens`` of the final usage event, else the
  number of content chunks. Prompt tokens: usage ``prompt_tokens``, else the dataset's.
* Duration: earliest send to latest end. Request throughput = successful requests /
  duration; output token throughput = their output tokens / duration; total token
  throughput = (prompt + output tokens) / duration; goodput = requests that met every
  SLO given / duration. Peak output throughput: the most content chunks in one whole
  second of the run; peak concurrency: the most requests in flight at once.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxserve.bench.client import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")   # --percentile-metrics choices


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


def pct_key(p: float) -> str:
    return f"p{p:g}_ms"


def summarize(values: Sequence[float],
              percentiles: Sequence[float] = (99,)) -> dict[str, float | None]:
    """mean / median / std / each percentile, in milliseconds (None with no values)."""
    keys = ["mean_ms", "median_ms", "std_ms", *map(pct_key, percentiles)]
    if not values:
        return dict.fromkeys(keys)
    ms = np.asarray(values, dtype=np.float64) * 1e3
    out = {"mean_ms": float(ms.mean()), "median_ms": float(np.median(ms)),
           "std_ms": float(ms.std())}
    out.update({pct_key(p): float(np.percentile(ms, p)) for p in percentiles})
    return out


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (SLOs given in ms, kept in s)."""
    slos = {}
    for item in items:
        name, _, ms = item.partition(":")
        if name not in METRICS or name == "itl":
            raise ValueError(f"goodput SLO {item!r}: the metric must be ttft, tpot or e2el")
        try:
            slos[name] = float(ms) / 1e3
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: give milliseconds, e.g. {name}:500") from None
        if not slos[name] > 0:
            raise ValueError(f"goodput SLO {item!r}: milliseconds must be > 0")
    return slos


def _meets(rec: RequestRecord, slos: dict[str, float]) -> bool:
    got = {"ttft": ttft(rec), "tpot": tpot(rec), "e2el": e2e(rec)}
    return all(got[k] is None or got[k] <= limit for k, limit in slos.items())


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    events = sorted([(r.send, 1) for r in records] + [(r.end, -1) for r in records])
    peak = now = 0
    for _, step in events:   # at equal times an end (-1) sorts first
        now += step
        peak = max(peak, now)
    return peak


def aggregate(records: Sequence[RequestRecord], percentiles: Sequence[float] = (99,),
              goodput: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    duration = (max(r.end for r in records) - min(r.send for r in records)) if records else 0.0
    prompt_toks = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    output_toks = sum(r.output_tokens for r in ok)

    def per_s(x: float) -> float | None:
        return x / duration if duration > 0 else None

    per_second = Counter(int(t) for r in ok for t in r.chunk_times)
    return {"completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
            "total_input_tokens": prompt_toks, "total_output_tokens": output_toks,
            "request_throughput": per_s(len(ok)),
            "request_goodput": (per_s(sum(_meets(r, goodput) for r in ok)) if goodput
                                else None),
            "output_throughput": per_s(output_toks),
            "total_token_throughput": per_s(prompt_toks + output_toks),
            "max_output_tokens_per_s": max(per_second.values(), default=0),
            "max_concurrent_requests": peak_concurrency(records),
            "ttft": summarize([t for t in map(ttft, ok) if t is not None], percentiles),
            "tpot": summarize([t for t in map(tpot, ok) if t is not None], percentiles),
            "itl": summarize([g for r in ok for g in itls(r)], percentiles),
            "e2el": summarize([e2e(r) for r in ok], percentiles),
            "errors": [r.error for r in records if not r.success][:5]}
