"""Prometheus metrics (prometheus-client), one registry per server, under vLLM's names.

A dashboard made for vLLM reads jaxserve as it reads vLLM: the `vllm:` metrics have
vLLM V1's names, types, units and `model_name` label (a Counter named "vllm:x" is
exposed as "vllm:x_total", as vLLM's are). What only jaxserve has is under `jaxserve:`.

Where the numbers come from:
- gauges and engine totals: the engine's stats snapshot (EngineStats), read at each
  scrape. A total (tokens, prefix-cache queries and hits, preemptions) moves its
  counter by its growth since the previous scrape, so the counter never goes down.
- request histograms and request_success: each engine request's outputs as they
  stream by, with the timeline the engine stamps on them (RequestMetrics); see
  RequestTracker. Timing histograms take one observation per engine request (one
  prompt, its n completions timed together, as the engine times them); the
  request_success counter and the token-count histograms one per completion, as vLLM
  counts its n child requests.
- speculative decoding (vLLM's spec_decode counters): the engine's totals of drafts
  (rows that verified some), draft tokens, accepted tokens and accepted tokens at each
  draft position, moved as the other totals are. As vLLM, they exist only when
  speculative decoding is on: registered when the Metrics is made with
  num_speculative_tokens, else at the first stats snapshot that has per-position
  counts (the scheduler keeps one per draft position only when it drafts).
- the host tier's restore transfer times: a histogram whose bucket counts the engine
  keeps itself (runner/transfer_timer.py), exposed as they stand at each scrape.
"""
from __future__ import annotations

import itertools
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily

from jaxserve.core.host_cache import RESTORE_TIME_BUCKETS
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.request_metrics import RequestMetrics
from jaxserve.core.scheduler import SchedulerStats

# Bucket choices follow vLLM's (a finer low end for ITL: a fast accelerator decodes a
# token in well under 10 ms).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# 1, 2, 5, 10, 20, 50, ... 1M tokens.
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)

FINISH_REASONS = ("stop", "length", "abort", "error")

# EngineStats field -> (counter name, help): engine totals exposed as counters.
_ENGINE_TOTALS = {
    "num_prompt_tokens": ("vllm:prompt_tokens", "Prompt tokens of the prefills that completed."),
    "num_generation_tokens": ("vllm:generation_tokens", "Tokens generated."),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "Tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "Tokens the prefix cache had."),
    "num_preemptions": ("vllm:num_preemptions",
                        "Requests preempted (pages taken back, to be recomputed)."),
}

# Speculative decoding totals, under vLLM V1's names and help (vllm/v1/spec_decode/
# metrics.py, SpecDecodingProm). From these:
#   acceptance rate: rate(..._accepted_tokens_total) / rate(..._draft_tokens_total)
#   mean acceptance length (with the bonus token):
#     1 + rate(..._accepted_tokens_total) / rate(vllm:spec_decode_num_drafts_total)
#   per-position acceptance rate:
#     rate(..._accepted_tokens_per_pos_total) / rate(vllm:spec_decode_num_drafts_total)
_SPEC_TOTALS = {
    "spec_num_drafts": ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    "spec_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    "spec_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",
                                 "Number of accepted tokens."),
}
_SPEC_PER_POS = ("vllm:spec_decode_num_accepted_tokens_per_pos",
                 "Accepted tokens per draft position.")

# The prefix cache's host tier (--kv-offloading-size), registered with the first snapshot
# that has one: HostCacheStats field -> (counter name, help). vLLM counts an offloading
# connector's hits as "external" (vllm:prefix_cache_hits are then the device's alone).
_HOST_TOTALS = {
    "queries": ("vllm:external_prefix_cache_queries",
                "Tokens looked up in the host tier (past each look-up's device hit)."),
    "hits": ("vllm:external_prefix_cache_hits", "Tokens the host tier had."),
    "bytes_offloaded": ("jaxserve:host_cache_offloaded_bytes",
                        "Bytes of KV pages and state snapshots copied device -> host."),
    "bytes_restored": ("jaxserve:host_cache_restored_bytes",
                       "Bytes of KV pages and state snapshots copied host -> device."),
    "restore_seconds": ("jaxserve:host_cache_restore_seconds",
                        "Host time spent dispatching restores (gathering the host rows and "
                        "starting their transfer)."),
}
# Gemma 4's sliding-window pages have a host index of their own (HostCache.sliding), its
# slots apart from the page slots: registered with the first snapshot whose tier has one.
_HOST_SLIDING_TOTALS = {
    "sliding_pages_offloaded": ("jaxserve:host_cache_sliding_offloaded_pages",
                                "Sliding-window KV pages copied device -> host."),
    "sliding_pages_restored": ("jaxserve:host_cache_sliding_restored_pages",
                               "Sliding-window KV pages copied host -> device (a hit's "
                               "last window's, at most)."),
}


class _RestoreTimes:
    """The host tier's restore transfer-time histogram, from the engine's own bucket
    counts (HostCacheStats.restore_time_buckets: RESTORE_TIME_BUCKETS then +Inf)."""

    NAME = "jaxserve:host_cache_restore_transfer_seconds"
    HELP = ("Time from a step's host-tier restore send until its rows were on the device "
            "(the host -> device transfer), one per step that restored.")

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.buckets: tuple[int, ...] = (0,) * (len(RESTORE_TIME_BUCKETS) + 1)
        self.sum = 0.0

    def collect(self):
        family = HistogramMetricFamily(self.NAME, self.HELP, labels=["model_name"])
        bounds = [str(b) for b in RESTORE_TIME_BUCKETS] + ["+Inf"]
        family.add_metric([self.model_name], list(zip(bounds, itertools.accumulate(self.buckets))),
                          self.sum)
        yield family


class Metrics:
    # The host tier's counters, seen totals and usage gauges, registered by the first
    # snapshot that has a host tier (_add_host).
    _host: dict | None = None
    _lora: Gauge | None = None   # vllm:lora_requests_info, registered once LoRA reports

    def __init__(self, model_name: str, num_speculative_tokens: int = 0):
        """num_speculative_tokens: the speculative config's (0: off, or not known yet;
        the spec_decode counters then appear with the first snapshot that has them)."""
        self.registry = r = CollectorRegistry()
        label = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model_name"], registry=r).labels(**label)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=r).labels(**label)

        self._counter, self._gauge = counter, gauge

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets,
                             registry=r).labels(**label)

        # ---- vLLM's: the engine's state ----
        self.running = gauge("vllm:num_requests_running",
                             "Number of requests (sequences) in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting",
                             "Number of requests (sequences) waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "Fraction of KV-cache pages in use (0-1).")
        self._totals = {field: counter(name, doc)
                        for field, (name, doc) in _ENGINE_TOTALS.items()}
        self._seen = dict.fromkeys(_ENGINE_TOTALS, 0)

        # ---- vLLM's: per request ----
        self._success = Counter("vllm:request_success",
                                "Requests (completions) finished, by why they finished.",
                                ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        for reason in FINISH_REASONS:   # present at 0 before the first request
            self._success.labels(model_name=model_name, finished_reason=reason)
        self.prompt_tokens_hist = histogram("vllm:request_prompt_tokens",
                                            "Prompt length of finished requests, in tokens.",
                                            _TOKEN_BUCKETS)
        self.generation_tokens_hist = histogram("vllm:request_generation_tokens",
                                                "Tokens each finished request generated.",
                                                _TOKEN_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Arrival to first generated token, seconds.", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between two steps that gave a request tokens, seconds.",
                             _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Arrival to finish, seconds.", _REQUEST_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Arrival to first scheduled, seconds.", _REQUEST_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "First scheduled to first token, seconds.",
                                      _REQUEST_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "First token to last token, seconds.", _REQUEST_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "First scheduled to last token, seconds.",
                                        _REQUEST_BUCKETS)

        # ---- jaxserve's own ----
        self.compilations = gauge("jaxserve:num_compilations",
                                  "XLA compilations in this process (flat after warmup).")
        self.admitted = gauge("jaxserve:num_sequences_admitted",
                              "Sequences (n per prompt) the server admitted that the engine "
                              "has not finished; less the running ones, what "
                              "--max-waiting-requests limits.")
        # Gauges of the input processor's own counts (it counts; a counter here could
        # only mirror them): each engine request (one per prompt) is checked once.
        self.processed = gauge("jaxserve:num_requests_processed",
                               "Engine requests (one per prompt) the input processor accepted.")
        self.refused = gauge("jaxserve:num_requests_refused",
                             "Engine requests the input processor refused (400s).")

        # ---- vLLM's: speculative decoding (only when it is on) ----
        self._spec_per_pos: list = []     # one counter per draft position
        self._spec_per_pos_seen: list[int] = []
        self.num_speculative_tokens = 0
        if num_speculative_tokens:
            self.enable_spec_decode(num_speculative_tokens)

    def enable_spec_decode(self, num_speculative_tokens: int) -> None:
        """Registers the spec_decode counters (at zero), with one `position` per draft
        position (0 .. num_speculative_tokens - 1). Once: later calls change nothing."""
        if self.num_speculative_tokens or num_speculative_tokens < 1:
            return
        self.num_speculative_tokens = num_speculative_tokens
        for field, (name, doc) in _SPEC_TOTALS.items():
            self._totals[field] = self._counter(name, doc)
            self._seen[field] = 0
        per_pos = Counter(_SPEC_PER_POS[0], _SPEC_PER_POS[1], ["model_name", "position"],
                          registry=self.registry)
        self._spec_per_pos = [per_pos.labels(model_name=self._model_name, position=str(i))
                              for i in range(num_speculative_tokens)]
        self._spec_per_pos_seen = [0] * num_speculative_tokens

    def render(self, stats: SchedulerStats, *, admitted: int, processed: int = 0, refused: int = 0) -> bytes:
        """stats: the engine's EngineStats snapshot."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        if stats.spec_accepted_per_pos and not self.num_speculative_tokens:
            self.enable_spec_decode(len(stats.spec_accepted_per_pos))
        self._add_totals(stats)
        if stats.host is not None:
            self._add_host(stats.host)
        self.compilations.set(stats.num_compilations)
        self.admitted.set(admitted)
        self.processed.set(processed)
        self.refused.set(refused)
        if stats.max_lora:
            self._lora_info(stats)
        return generate_latest(self.registry)

    def _lora_info(self, stats: SchedulerStats) -> None:
        """vLLM's vllm:lora_requests_info: one sample, its labels the adapters running
        and waiting (comma-separated names) and the slots, its value the time."""
        if self._lora is None:   # registered with the first snapshot of a LoRA engine
            self._lora = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                               registry=self.registry)
        self._lora.clear()
        self._lora.labels(max_lora=str(stats.max_lora),
                          waiting_lora_adapters=",".join(stats.waiting_lora_adapters),
                          running_lora_adapters=",".join(stats.running_lora_adapters)
                          ).set(time.time())

    def render_idle(self) -> bytes:
        """Before the engine exists: every gauge and counter at zero."""
        return generate_latest(self.registry)

    def _add_totals(self, stats) -> None:
        for field, counter in self._totals.items():
            self._seen[field] = _advance(counter, self._seen[field], getattr(stats, field))
        seen = self._spec_per_pos_seen
        for i, (counter, value) in enumerate(zip(self._spec_per_pos,
                                                 stats.spec_accepted_per_pos)):
            seen[i] = _advance(counter, seen[i], value)

    def _add_host(self, host) -> None:
        if self._host is None:
            totals = {**_HOST_TOTALS, **(_HOST_SLIDING_TOTALS if host.sliding_capacity else {})}
            self._host = {f: self._counter(name, doc) for f, (name, doc) in totals.items()}
            self._host_seen = dict.fromkeys(totals, 0)
            self.host_usage = self._gauge("jaxserve:host_cache_usage_perc", "Fraction of the "
                                          "host tier's page slots in use (0-1).")
            self.host_sliding_usage = self._gauge(
                "jaxserve:host_cache_sliding_usage_perc", "Fraction of the host tier's "
                "sliding-window page slots in use (0-1).") if host.sliding_capacity else None
            self.host_state_usage = self._gauge(
                "jaxserve:host_cache_state_usage_perc", "Fraction of the host tier's "
                "state snapshot slots (hybrid models) in use (0-1).") \
                if host.state_capacity else None
            self.restore_times = _RestoreTimes(self._model_name)
            self.registry.register(self.restore_times)
        if host.restore_time_buckets:
            self.restore_times.buckets = host.restore_time_buckets
            self.restore_times.sum = host.restore_time_sum
        for field, counter in self._host.items():
            self._host_seen[field] = _advance(counter, self._host_seen[field],
                                              getattr(host, field))
        self.host_usage.set(host.usage)
        if self.host_sliding_usage is not None:
            self.host_sliding_usage.set(host.sliding_usage)
        if self.host_state_usage is not None:
            self.host_state_usage.set(host.state_usage)

    # ---- per request ---------------------------------------------------------------
    def track(self, num_prompt_tokens: int, n: int) -> RequestTracker:
        """A tracker for one engine request (a prompt with n completions)."""
        return RequestTracker(self, num_prompt_tokens, n)

    def observe_sequence(self, finished_reason: str, num_prompt: int, num_generated: int) -> None:
        """One completion finished."""
        self._success.labels(model_name=self._model_name, finished_reason=finished_reason).inc()
        self.prompt_tokens_hist.observe(num_prompt)
        self.generation_tokens_hist.observe(num_generated)

    def observe_finished(self, m: RequestMetrics) -> None:
        """An engine request finished: its intervals (those that happened)."""
        for hist, value in ((self.e2e, m.e2e_latency), (self.queue_time, m.time_in_queue),
                            (self.prefill_time, m.prefill_time),
                            (self.decode_time, m.decode_time),
                            (self.inference_time, m.inference_time)):
            if value is not None:
                hist.observe(value)


def _advance(counter, seen: int, value: int) -> int:
    """Moves `counter` by the total's growth since `seen`; -> the new baseline. A total
    that went down (counts restarted) is a new baseline, never a drop."""
    if value > seen:
        counter.inc(value - seen)
    return value


class RequestTracker:
    """What the metrics take from one engine request's stream of delta outputs: TTFT
    when its first token comes, one inter-token latency per later step that gave it
    tokens (as vLLM observes each iteration's gap), its intervals when it finishes, and
    one request_success per completion."""

    def __init__(self, metrics: Metrics, num_prompt_tokens: int, n: int):
        self._metrics = metrics
        self._num_prompt = num_prompt_tokens
        self._n = n
        self._tokens: dict[int, int] = {}   # completion index -> tokens so far
        self._done: set[int] = set()        # completions whose finish was counted
        self._last_token_time: float | None = None

    def update(self, out: RequestOutput) -> None:
        metrics = self._metrics
        for c in out.outputs:
            self._tokens[c.index] = self._tokens.get(c.index, 0) + len(c.token_ids)
            if c.finish_reason is not None and c.index not in self._done:
                self._done.add(c.index)
                metrics.observe_sequence(c.finish_reason, self._num_prompt,
                                         self._tokens[c.index])
        m = out.metrics
        if m is None:
            return
        # Every step that gave this request tokens moved its last_token_time.
        if m.last_token_time is not None and m.last_token_time != self._last_token_time:
            if self._last_token_time is None:
                metrics.ttft.observe(m.time_to_first_token)
            else:
                metrics.itl.observe(m.last_token_time - self._last_token_time)
            self._last_token_time = m.last_token_time
        if out.finished:
            metrics.observe_finished(m)

    def close(self) -> None:
        """The stream ended. Completions whose finish never came (the client left, the
        engine failed the request, the server shut down) count as aborted."""
        for i in range(self._n):
            if i not in self._done:
                self._done.add(i)
                self._metrics.observe_sequence("abort", self._num_prompt,
                                               self._tokens.get(i, 0))
