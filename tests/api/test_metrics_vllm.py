"""/metrics under vLLM's names (what vLLM dashboards read), the per-request timeline the
engine stamps, the periodic stats line, and the Grafana dashboard's queries."""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.api.metrics import Metrics
from jaxserve.api.server import create_app
from jaxserve.api.settings import ServerSettings
from jaxserve.api.stats_logger import StatsLogger
from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.core.request_metrics import RequestMetrics
from jaxserve.engine.async_engine import EngineStats
from jaxserve.engine.input_processor import InputProcessor
from tests.api.conftest import API_KEY, leave_mid_stream

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "jaxserve-vllm.json"

# The names vLLM V1 exposes that a vLLM dashboard reads (counters with their _total).
VLLM_NAMES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket")


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, its labels sorted) -> value, of a Prometheus text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(snap: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 if none)."""
    return sum(v for (n, ls), v in snap.items()
               if n == name and set(labels.items()) <= set(ls))


def exported_names() -> set[str]:
    """Every sample name a fresh Metrics registry exports."""
    return {s.name for family in Metrics("m").registry.collect() for s in family.samples}


# ---- the registry, without an engine ---------------------------------------------------
def test_vllm_names_with_model_name_and_no_duplicates():
    snap = samples(Metrics("my-model").render_idle().decode())
    names = {n for n, _ in snap}
    for name in VLLM_NAMES:
        assert name in names, name
    for (name, labels), _ in snap.items():
        if name.startswith(("vllm:", "jaxserve:")):
            assert ("model_name", "my-model") in labels, name
    assert {dict(ls)["finished_reason"] for n, ls in snap
            if n == "vllm:request_success_total"} == {"stop", "length", "abort", "error"}
    # No metric twice: nothing of jaxserve's repeats a vLLM name.
    ours = {n.split(":", 1)[1] for n in names if n.startswith("jaxserve:")}
    theirs = {n.split(":", 1)[1] for n in names if n.startswith("vllm:")}
    assert ours and not ours & theirs
    assert not any(n.startswith("jaxserve:") and ("prefix_cache" in n or "preemption" in n
                                                 or "tokens" in n) for n in names)


def test_engine_totals_are_counters_that_never_go_down():
    metrics = Metrics("m")

    def render(**totals) -> dict:
        return samples(metrics.render(EngineStats(**totals), admitted=0).decode())

    first = dict(num_prompt_tokens=40, num_generation_tokens=7, prefix_cache_queries=80,
                 prefix_cache_hits=32, num_preemptions=1)
    snap = render(**first)
    names = {"num_prompt_tokens": "vllm:prompt_tokens_total",
             "num_generation_tokens": "vllm:generation_tokens_total",
             "prefix_cache_queries": "vllm:prefix_cache_queries_total",
             "prefix_cache_hits": "vllm:prefix_cache_hits_total",
             "num_preemptions": "vllm:num_preemptions_total"}
    for field, name in names.items():
        assert value(snap, name) == first[field]
    later = {k: v * 3 for k, v in first.items()}
    snap = render(**later)
    for field, name in names.items():
        assert value(snap, name) == later[field]
    # The engine's counts restarting from zero is a new baseline, never a drop ...
    restarted = {k: 2 for k in first}
    snap = render(**restarted)
    for field, name in names.items():
        assert value(snap, name) == later[field]
    # ... from which the counters grow again.
    snap = render(**{k: 5 for k in first})
    for field, name in names.items():
        assert value(snap, name) == later[field] + 3


def _out(m: RequestMetrics, *completions: tuple[int, int, str | None],
         finished: bool = False) -> RequestOutput:
    """A delta output: (index, new tokens, finish reason) per completion in it."""
    return RequestOutput("r", None, [1, 2, 3], None,
                         [CompletionOutput(i, "", [7] * k, None, None, reason)
                          for i, k, reason in completions], finished, metrics=m)


def test_tracker_feeds_ttft_itl_intervals_and_finish_reasons():
    metrics = Metrics("m")
    tracker = metrics.track(num_prompt_tokens=3, n=2)
    arrival, scheduled, token_times = 100.0, 100.25, [101.0, 101.5, 103.0]
    m = RequestMetrics(arrival, first_scheduled_time=scheduled)
    # Both completions get a token at each step (one output per step: one gap); at the
    # last, completion 0 stops and completion 1 reaches its length.
    for k, t in enumerate(token_times):
        m.first_token_time = m.first_token_time or t
        m.last_token_time = t
        last = k == len(token_times) - 1
        if last:
            m.finished_time = t
        tracker.update(_out(m, (0, 1, "stop" if last else None),
                            (1, 1, "length" if last else None), finished=last))
    tracker.update(_out(m))   # an output with nothing new: no observation
    tracker.close()           # everything finished: no abort
    snap = samples(metrics.render_idle().decode())

    def hist(name: str) -> tuple[float, float]:
        return (value(snap, f"vllm:{name}_count"), value(snap, f"vllm:{name}_sum"))

    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    assert hist("time_to_first_token_seconds") == (1, token_times[0] - arrival)
    assert hist("inter_token_latency_seconds") == (len(gaps), pytest.approx(sum(gaps)))
    assert hist("request_queue_time_seconds") == (1, scheduled - arrival)
    assert hist("request_prefill_time_seconds") == (1, token_times[0] - scheduled)
    assert hist("request_decode_time_seconds") == (1, token_times[-1] - token_times[0])
    assert hist("request_inference_time_seconds") == (1, token_times[-1] - scheduled)
    assert hist("e2e_request_latency_seconds") == (1, token_times[-1] - arrival)
    for reason, count in (("stop", 1), ("length", 1), ("abort", 0)):
        assert value(snap, "vllm:request_success_total", finished_reason=reason) == count
    # One observation per completion.
    assert hist("request_generation_tokens") == (2, 2 * len(token_times))
    assert hist("request_prompt_tokens") == (2, 2 * 3)


def test_completions_that_never_finish_count_as_aborted():
    metrics = Metrics("m")
    tracker = metrics.track(num_prompt_tokens=5, n=3)
    m = RequestMetrics(10.0, first_scheduled_time=10.5, first_token_time=11.0,
                       last_token_time=11.0)
    tracker.update(_out(m, (0, 1, None), (1, 1, "stop"), (2, 1, None)))
    m.last_token_time = 11.5
    tracker.update(_out(m, (0, 1, None)))
    tracker.close()   # the client left
    tracker.close()   # (once only)
    snap = samples(metrics.render_idle().decode())
    for reason, count in (("stop", 1), ("length", 0), ("abort", 2)):
        assert value(snap, "vllm:request_success_total", finished_reason=reason) == count
    assert value(snap, "vllm:request_generation_tokens_sum") == 2 + 1 + 1
    # Intervals are of finished requests only; TTFT and ITL as the tokens came.
    assert value(snap, "vllm:e2e_request_latency_seconds_count") == 0
    assert value(snap, "vllm:time_to_first_token_seconds_sum") == 1.0
    assert value(snap, "vllm:inter_token_latency_seconds_sum") == 0.5


# ---- the stats line ---------------------------------------------------------------------
class FakeEngine:
    """What the stats logger and create_app read of an engine."""
    tokenizer = None
    dead = False

    def __init__(self, **stats):
        self.stats = EngineStats(**stats)
        self.inputs = InputProcessor(tokenizer=None, vocab_size=100, max_model_len=64)


def test_stats_line_throughputs_and_idle_skipping(caplog):
    caplog.set_level(logging.INFO, logger="jaxserve")
    engine = FakeEngine()
    stats_logger = StatsLogger(engine, interval=10.0)
    assert stats_logger.tick(now=1000.0) is None          # idle: nothing to say
    engine.stats = EngineStats(num_running=3, num_waiting=1, kv_cache_usage=0.25,
                               num_prompt_tokens=120, num_generation_tokens=45,
                               prefix_cache_queries=200, prefix_cache_hits=50)
    line = stats_logger.tick(now=1004.0)
    assert line == ("Engine 000: Avg prompt throughput: 30.0 tokens/s, Avg generation "
                    "throughput: 11.2 tokens/s, Running: 3 reqs, Waiting: 1 reqs, KV cache "
                    "usage: 25.0%, Prefix cache hit rate: 25.0%")
    assert caplog.records[-1].name == "jaxserve" and caplog.records[-1].getMessage() == line
    # Work stopped: one more line shows the drop to zero, then silence.
    engine.stats = EngineStats(num_prompt_tokens=120, num_generation_tokens=45,
                               prefix_cache_queries=200, prefix_cache_hits=50)
    assert "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs" in \
        stats_logger.tick(now=1008.0)
    assert stats_logger.tick(now=1012.0) is None
    assert stats_logger.tick(now=1016.0) is None


def test_the_app_logs_stats_unless_disabled(caplog):
    caplog.set_level(logging.INFO, logger="jaxserve")
    engine = FakeEngine(num_running=2, num_generation_tokens=10)
    app = create_app(engine, ServerSettings(served_model_names=("m",), max_model_len=64,
                                            log_stats_interval=0.05))
    try:
        deadline = time.monotonic() + 10
        while not any(r.getMessage().startswith("Engine 000: ") for r in caplog.records):
            assert time.monotonic() < deadline, "no stats line was logged"
            time.sleep(0.02)
    finally:
        app.state.stats_logger.stop()
    quiet = create_app(FakeEngine(), ServerSettings(served_model_names=("m",),
                                                    max_model_len=64, disable_log_stats=True))
    assert quiet.state.stats_logger is None


# ---- the Grafana dashboard --------------------------------------------------------------
def _queries(node) -> list[str]:
    """Every PromQL text in the dashboard: panel targets and template variable queries."""
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("expr", "definition") and isinstance(v, str):
                found.append(v)
            elif k == "query" and isinstance(v, dict) and isinstance(v.get("query"), str):
                found.append(v["query"])
            else:
                found += _queries(v)
    elif isinstance(node, list):
        for v in node:
            found += _queries(v)
    return found


def test_grafana_dashboard_queries_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _queries(dashboard)
    assert len(queries) >= 10
    referenced = set()
    for q in queries:
        # Selectors (name{...}) and bare names with a metric prefix.
        referenced |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_:]*(?=\{)", q))
        referenced |= set(re.findall(r"\b(?:vllm|jaxserve):[A-Za-z0-9_:]+", q))
    missing = referenced - exported_names()
    assert not missing, f"the dashboard queries metrics jaxserve does not export: {missing}"
    # The panels the dashboard promises.
    for name in ("vllm:request_success_total", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:request_queue_time_seconds_bucket"):
        assert name in referenced, name
    assert any("histogram_quantile" in q for q in queries)


# ---- a real server ----------------------------------------------------------------------
def _scrape(server) -> dict:
    return samples(httpx.get(server.url + "/metrics").text)


def _post(server, body: dict) -> dict:
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_vllm_metrics_move_as_requests_run(server, api_checkpoint):
    model = api_checkpoint
    before = _scrape(server)
    # A request cut by max_tokens, one stopped by a stop string, and a repeated prompt
    # of several pages (the second finds them in the prefix cache).
    length = _post(server, {"model": model, "prompt": [11, 12, 13], "max_tokens": 4,
                            "ignore_eos": True})
    assert length["choices"][0]["finish_reason"] == "length"
    kw = {"model": model, "prompt": "Hello, my name is", "max_tokens": 30, "temperature": 0}
    text = _post(server, kw)["choices"][0]["text"]
    stopped = _post(server, {**kw, "stop": [text[8:11]]})
    assert stopped["choices"][0]["finish_reason"] == "stop"
    long_prompt = [(7 * i) % 200 + 3 for i in range(48)]
    for _ in range(2):
        _post(server, {"model": model, "prompt": long_prompt, "max_tokens": 2,
                       "ignore_eos": True})
    after = _scrape(server)

    def grew(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("vllm:request_success_total", finished_reason="length") >= 3
    assert grew("vllm:request_success_total", finished_reason="stop") >= 1
    # Five requests: each has a first token, a queue time and an e2e latency.
    for hist in ("time_to_first_token_seconds", "request_queue_time_seconds",
                 "e2e_request_latency_seconds", "request_prefill_time_seconds"):
        assert grew(f"vllm:{hist}_count") >= 5, hist
        assert grew(f"vllm:{hist}_sum") > 0, hist
    assert grew("vllm:inter_token_latency_seconds_count") >= 3   # the 4-token request's gaps
    assert grew("vllm:prompt_tokens_total") >= 3 + 2 * len(long_prompt)
    assert grew("vllm:generation_tokens_total") >= 4 + 2 * 2
    assert grew("vllm:prefix_cache_queries_total") >= 2 * len(long_prompt)
    assert grew("vllm:prefix_cache_hits_total") >= 16   # at least one page of the repeat
    assert grew("vllm:request_prompt_tokens_count") >= 5
    for (name, labels), _ in after.items():
        if name.startswith("vllm:"):
            assert ("model_name", model) in labels, name


def test_a_client_that_leaves_counts_as_aborted(server, api_checkpoint):
    aborted = lambda: value(_scrape(server), "vllm:request_success_total",  # noqa: E731
                            finished_reason="abort")
    before = aborted()
    leave_mid_stream(server, api_checkpoint)
    deadline = time.monotonic() + 20
    while aborted() < before + 1:
        assert time.monotonic() < deadline, "the aborted request was not counted"
        time.sleep(0.1)


def test_the_server_logs_the_stats_line(server, api_checkpoint):
    # The real wiring: the CLI's app and engine, its logging; one line per 10 s of work.
    _post(server, {"model": api_checkpoint, "prompt": [9, 8, 7], "max_tokens": 2})
    deadline = time.monotonic() + 30
    pattern = re.compile(r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation "
                         r"throughput: [\d.]+ tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, "
                         r"KV cache usage: [\d.]+%, Prefix cache hit rate: [\d.]+%")
    while not pattern.search(server.output()):
        assert time.monotonic() < deadline, "no stats line in the server's log"
        time.sleep(0.5)
