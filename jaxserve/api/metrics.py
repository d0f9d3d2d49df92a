"""Prometheus metrics (prometheus-client), one registry per server."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        label = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model_name"], registry=r).labels(**label)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=r).labels(**label)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=_LATENCY_BUCKETS,
                             registry=r).labels(**label)

        self.running = gauge("jaxserve:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("jaxserve:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("jaxserve:kv_cache_usage_perc",
                              "Fraction of KV cache pages in use (0-1).")
        self.prefix_hit_rate = gauge("jaxserve:prefix_cache_hit_rate",
                                     "Prefix-cache hits / queries, in tokens (0-1).")
        self.compilations = gauge("jaxserve:num_compilations",
                                  "XLA compilations in this process (flat after warmup).")
        self.preemptions = gauge("jaxserve:num_preemptions", "Requests preempted so far.")
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
        self.prompt_tokens = counter("jaxserve:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("jaxserve:generation_tokens", "Tokens generated.")
        self.requests_finished = counter("jaxserve:request_success", "Requests finished.")
        self.ttft = histogram("jaxserve:time_to_first_token_seconds", "Time to first token.")
        self.tpot = histogram("jaxserve:time_per_output_token_seconds",
                              "Time per output token after the first.")
        self.e2e = histogram("jaxserve:e2e_request_latency_seconds", "End-to-end latency.")

    def render(self, stats, *, admitted: int, processed: int = 0, refused: int = 0) -> bytes:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        self.compilations.set(stats.num_compilations)
        self.preemptions.set(stats.num_preemptions)
        self.admitted.set(admitted)
        self.processed.set(processed)
        self.refused.set(refused)
        return generate_latest(self.registry)

    def render_idle(self) -> bytes:
        """Before the engine exists: every gauge and counter at zero."""
        return generate_latest(self.registry)

    def observe_request(self, *, arrival: float, first_token: float | None, end: float,
                        num_prompt: int, num_output: int) -> None:
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_output)
        self.requests_finished.inc()
        self.e2e.observe(end - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if num_output > 1:
                self.tpot.observe((end - first_token) / (num_output - 1))
