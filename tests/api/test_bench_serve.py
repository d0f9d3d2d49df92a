"""`jaxserve bench serve` against the session's real server: it prints vLLM's result
lines, writes vLLM's --save-result JSON, and its counts agree with the server's own
/metrics counters for the same run (its times bound the server's from above: the
client's clock starts before the server's and stops after it)."""
from __future__ import annotations

import json

import httpx
import pytest

from jaxserve.cli.main import main as jaxserve
from tests.api.conftest import API_KEY
from tests.api.test_metrics_vllm import samples, value


def scrape(server) -> dict:
    return samples(httpx.get(server.url + "/metrics").text)


def bench(server, model: str, *flags: str) -> None:
    jaxserve(["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--model", model,
              "--disable-tqdm", "--ready-check-timeout-sec", "30", *flags])


def test_bench_serve_prints_saves_and_agrees_with_server_metrics(server, api_checkpoint,
                                                                 tmp_path, capsys):
    n, n_in, n_out = 6, 8, 4
    before = scrape(server)
    bench(server, api_checkpoint, "--dataset-name", "random", "--num-prompts", str(n),
          "--random-input-len", str(n_in), "--random-output-len", str(n_out),
          "--random-vocab-size", "200", "--ignore-eos", "--max-concurrency", "3",
          "--request-rate", "50", "--percentile-metrics", "ttft,tpot,itl,e2el",
          "--metric-percentiles", "50,99", "--save-result", "--save-detailed",
          "--result-dir", str(tmp_path), "--label", "ci", "--metadata", "run=smoke")
    after = scrape(server)
    out = capsys.readouterr().out

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # What it printed: vLLM's result block, with the percentiles asked for.
    assert "============ Serving Benchmark Result ============" in out
    for line in ("Successful requests:", "Total generated tokens:", "Mean TTFT (ms):",
                 "P50 TPOT (ms):", "P99 ITL (ms):", "Median E2EL (ms):",
                 "Maximum request concurrency:", "Peak concurrent requests:"):
        assert line in out, line
    assert "error:" not in out

    # What it wrote: one file, vLLM's name pattern and keys.
    (path,) = tmp_path.glob("ci-50qps-concurrency3-*.json")
    assert path.name in out
    doc = json.loads(path.read_text())
    assert (doc["completed"], doc["failed"], doc["num_prompts"]) == (n, 0, n)
    assert doc["model_id"] == api_checkpoint and doc["run"] == "smoke"
    assert doc["request_rate"] == 50.0 and doc["max_concurrency"] == 3
    assert 1 <= doc["max_concurrent_requests"] <= 3
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert doc[f"{stat}_{metric}_ms"] > 0, (stat, metric)
    assert doc["output_lens"] == [n_out] * n and doc["input_lens"] == [n_in] * n
    assert len(doc["ttfts"]) == n and all(t > 0 for t in doc["ttfts"])
    assert all(text for text in doc["generated_texts"]) and doc["errors"] == [""] * n

    # The server's counters for the same run: exact counts.
    assert grew("vllm:request_success_total", finished_reason="length") == n
    assert grew("vllm:request_success_total") == n
    assert doc["total_input_tokens"] == grew("vllm:prompt_tokens_total") == n * n_in
    assert doc["total_input_tokens"] == grew("vllm:request_prompt_tokens_sum")
    assert doc["total_output_tokens"] == grew("vllm:generation_tokens_total") == n * n_out
    assert doc["total_output_tokens"] == grew("vllm:request_generation_tokens_sum")
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert grew(f"vllm:{hist}_count") == n, hist
    # ... and times: each client interval contains the server's.
    assert grew("vllm:time_to_first_token_seconds_sum") <= sum(doc["ttfts"])
    assert grew("vllm:e2e_request_latency_seconds_sum") <= doc["mean_e2el_ms"] * n / 1e3
    client_gaps = sum(len(gaps) for gaps in doc["itls"])
    assert 0 < client_gaps <= grew("vllm:inter_token_latency_seconds_count") == n * (n_out - 1)


def test_bench_serve_prefix_repetition_hits_the_prefix_cache(server, api_checkpoint,
                                                             capsys):
    before = scrape(server)
    # One shared prefix of 48 tokens, one request at a time: every prompt after the
    # first finds the prefix's full pages cached.
    bench(server, api_checkpoint, "--dataset-name", "prefix_repetition", "--num-prompts", "4",
          "--prefix-repetition-prefix-len", "48", "--prefix-repetition-suffix-len", "4",
          "--prefix-repetition-num-prefixes", "1", "--prefix-repetition-output-len", "2",
          "--random-vocab-size", "200", "--max-concurrency", "1", "--ignore-eos")
    after = scrape(server)
    assert "Successful requests:                     4" in capsys.readouterr().out
    name = "vllm:prefix_cache_hits_total"
    hits = value(after, name) - value(before, name)
    assert hits >= 3 * 32   # at least two 16-token pages for each of the last three


def test_bench_serve_chat_backend(server, api_checkpoint, capsys):
    bench(server, api_checkpoint, "--backend", "openai-chat", "--num-prompts", "2",
          "--random-input-len", "5", "--random-output-len", "3", "--ignore-eos")
    out = capsys.readouterr().out
    assert "Successful requests:                     2" in out
    assert "Total generated tokens:                  6" in out


@pytest.mark.parametrize("flags, message", [
    (["--percentile-metrics", "ttft,nope"], "--percentile-metrics"),
    (["--metric-percentiles", "0"], "--metric-percentiles"),
    (["--goodput", "itl:5"], "--goodput"),
    (["--dataset-name", "sharegpt"], "--dataset-path"),
    (["--save-detailed"], "--save-result"),
    (["--request-rate", "0"], "request rate"),
])
def test_bench_serve_refuses_bad_flags_by_name(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        jaxserve(["bench", "serve", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err
