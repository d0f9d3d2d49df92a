"""jaxserve.bench (the client, datasets and metrics of `jaxserve bench serve` and
benchmarks/serving/serve.py) and benchmarks/serving/serve.py's sweep CLI: metric maths on synthetic timestamps (exact), SSE parsing, datasets,
arrivals, and whole runs against a fake streaming server on 127.0.0.1 whose sleeps are
known (wall-clock checks are lower bounds only: sleeps can only make things later)."""
from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402  (module level: FastAPI resolves annotations here)
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from benchmarks.serving.serve import format_summary, format_sweep_table, main
from jaxserve.bench.client import (CHAT, COMPLETIONS, BenchConfig, RequestRecord, build_payload,
                                   feed_line, run_benchmark)
from jaxserve.bench.datasets import Prompt, arrival_times, random_dataset, sharegpt_dataset
from jaxserve.bench.metrics import aggregate, e2e, itls, summarize, tpot, ttft
from tests.benchmarks.conftest import assert_figure  # noqa: E402

FIRST_DELAY, GAP = 0.2, 0.05   # fake server: seconds to the first chunk, between chunks
REJECT_ABOVE = 50              # fake server answers 400 when max_tokens is larger


# ----------------------------------------------------------------------------- fake server

def _chunk(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def make_fake_app(seen: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(body: dict, chat: bool):
        n, model = body["max_tokens"], body["model"]
        if chat:   # like OpenAI: a role-only first event, which is not content
            yield _chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(n):
            await asyncio.sleep(FIRST_DELAY if i == 0 else GAP)
            piece = {"delta": {"content": f" w{i}"}} if chat else {"text": f" w{i}"}
            yield _chunk({"choices": [{"index": 0, **piece}], "usage": None})
        if model == "truncate":
            return   # no [DONE]
        if model != "no-usage":
            prompt = body["messages"][0]["content"].split() if chat else body["prompt"]
            yield _chunk({"choices": [], "usage": {"prompt_tokens": len(prompt),
                                                   "completion_tokens": n}})
        yield b"data: [DONE]\n\n"

    async def handle(request: Request, chat: bool):
        body = await request.json()
        seen.append({**body, "_auth": request.headers.get("authorization")})
        if body["max_tokens"] > REJECT_ABOVE:
            return JSONResponse({"error": {"message": "max_tokens too large"}}, status_code=400)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def server():
    seen: list[dict] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(make_fake_app(seen), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started, "fake server did not start"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    srv.should_exit = True
    thread.join(timeout=5)
    sock.close()


def run(cfg: BenchConfig, prompts: list[Prompt], rate: float = math.inf) -> list[RequestRecord]:
    return asyncio.run(run_benchmark(cfg, prompts, rate))


# ----------------------------------------------------------------------------- pure metrics

def synthetic(send: float, chunks: list[float], end: float, out: int, ok: bool = True,
              prompt_tokens: int | None = 10) -> RequestRecord:
    return RequestRecord(prompt_len=7, max_tokens=out, send=send, end=end, chunk_times=chunks,
                         output_tokens=out, prompt_tokens=prompt_tokens, success=ok,
                         error="" if ok else "boom")


def test_per_request_metrics_exact():
    r = synthetic(1.0, [1.5, 1.75, 2.25, 2.5], 2.5, 4)
    assert ttft(r) == 0.5 and e2e(r) == 1.5
    assert tpot(r) == pytest.approx((1.5 - 0.5) / 3)
    assert itls(r) == [0.25, 0.5, 0.25]
    one = synthetic(0.0, [0.25], 0.5, 1)   # a single token has no TPOT and no ITL
    assert tpot(one) is None and itls(one) == []
    assert ttft(synthetic(0.0, [], 0.5, 0)) is None


def test_aggregate_exact():
    recs = [synthetic(0.0, [1.0, 2.0, 3.0], 3.0, 3),
            synthetic(1.0, [1.5, 2.0], 2.0, 4, prompt_tokens=None),  # 4 tokens packed in 2 chunks
            synthetic(2.0, [], 4.0, 0, ok=False)]
    a = aggregate(recs)
    assert (a["completed"], a["failed"], a["duration_s"]) == (2, 1, 4.0)
    assert a["total_input_tokens"] == 10 + 7   # usage, else the dataset estimate
    assert a["total_output_tokens"] == 7
    assert a["request_throughput"] == 0.5 and a["output_throughput"] == 7 / 4
    assert a["total_token_throughput"] == 24 / 4
    assert a["ttft"]["mean_ms"] == pytest.approx(750.0)
    assert a["tpot"]["mean_ms"] == pytest.approx((1000.0 + 500.0 / 3) / 2)
    assert a["itl"]["mean_ms"] == pytest.approx(1000.0 * (1 + 1 + 0.5) / 3)
    assert a["e2el"]["median_ms"] == pytest.approx(2000.0)
    assert a["errors"] == ["boom"]


def test_summarize_matches_numpy_and_handles_empty():
    vals = [0.001 * i for i in range(1, 101)]
    s = summarize(vals)
    assert s["mean_ms"] == pytest.approx(50.5) and s["median_ms"] == pytest.approx(50.5)
    assert s["p99_ms"] == pytest.approx(np.percentile(np.arange(1, 101), 99))
    assert s["std_ms"] == pytest.approx(np.std(np.arange(1, 101)))
    assert summarize([]) == {"mean_ms": None, "median_ms": None, "p99_ms": None, "std_ms": None}
    empty = aggregate([])
    assert empty["completed"] == 0 and empty["request_throughput"] is None
    assert "n/a" in format_summary(empty, math.inf)


def test_feed_line_sse_parsing():
    r = RequestRecord(prompt_len=1, max_tokens=3)
    assert not feed_line(r, "", 0.0) and not feed_line(r, ": keep-alive", 0.0)
    feed_line(r, 'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}', 1.0)
    feed_line(r, 'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}', 2.0)
    feed_line(r, 'data:{"choices":[{"text":"","token_ids":[5]}]}', 3.0)   # tokens, no text
    feed_line(r, 'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2}}', 4.0)
    assert r.chunk_times == [2.0, 3.0]
    assert (r.prompt_tokens, r.usage_completion_tokens) == (4, 2)
    assert feed_line(r, "data: [DONE]", 5.0)
    with pytest.raises(RuntimeError, match="overloaded"):
        feed_line(r, 'data: {"error":{"message":"overloaded"}}', 6.0)


def test_build_payload():
    p = Prompt([5, 6, 7], 3, 9)
    body = build_payload(COMPLETIONS, "m", p, ignore_eos=True, temperature=0.0)
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 9 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    chat = build_payload(CHAT, "m", Prompt("hi there", 2, 4), ignore_eos=False, temperature=0.0)
    assert chat["messages"] == [{"role": "user", "content": "hi there"}] and "ignore_eos" not in chat
    with pytest.raises(ValueError, match="token ids"):
        build_payload(CHAT, "m", p, ignore_eos=False, temperature=0.0)
    with pytest.raises(ValueError, match="/v1/embeddings"):
        build_payload("/v1/embeddings", "m", p, ignore_eos=False, temperature=0.0)


# ----------------------------------------------------------------------------- datasets, arrivals

def test_arrival_times_poisson_seeded():
    a, b = arrival_times(20_000, 4.0, seed=3), arrival_times(20_000, 4.0, seed=3)
    assert a == b and a != arrival_times(20_000, 4.0, seed=4)
    gaps = np.diff(a)
    assert a[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)   # exponential: std == mean
    assert arrival_times(5, math.inf, seed=0) == [0.0] * 5
    with pytest.raises(ValueError, match="request rate"):
        arrival_times(5, 0.0, seed=0)


def test_random_dataset():
    a = random_dataset(50, 100, 20, 0.5, seed=1, vocab_size=300)
    assert a == random_dataset(50, 100, 20, 0.5, seed=1, vocab_size=300)
    assert all(50 <= len(p.prompt) == p.prompt_len <= 150 and 10 <= p.output_len <= 30 for p in a)
    assert all(3 <= t < 300 for p in a for t in p.prompt)
    fixed = random_dataset(5, 8, 4, 0.0, seed=1, text=True)
    assert all(isinstance(p.prompt, str) and len(p.prompt.split()) == 8 and p.output_len == 4
               for p in fixed)
    with pytest.raises(ValueError, match="range ratio"):
        random_dataset(1, 8, 4, 1.0, seed=0)


def test_sharegpt_loader(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "What is two plus two?"},
                           {"from": "gpt", "value": "x" * 41}]},
        {"conversations": [{"from": "gpt", "value": "hello"}]},                    # no human turn
        {"conversations": [{"from": "human", "value": "only a question"}]},        # no reply
        {"conversations": [{"from": "system", "value": "be brief"},
                           {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hey"},
                           {"from": "human", "value": "later turn"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    got = sorted(sharegpt_dataset(str(path), 2, seed=0), key=lambda p: p.prompt)
    assert got == [Prompt("Hi", 1, 1), Prompt("What is two plus two?", 6, 11)]   # ceil(chars/4)
    assert all(p.output_len == 7 for p in sharegpt_dataset(str(path), 2, seed=0, output_len=7))
    with pytest.raises(ValueError, match="2 usable conversations, need 3"):
        sharegpt_dataset(str(path), 3, seed=0)


# ----------------------------------------------------------------------------- against the fake

def test_run_against_fake_server(server):
    url, seen = server
    prompts = random_dataset(4, 12, 5, 0.0, seed=0)
    recs = run(BenchConfig(base_url=url, ignore_eos=True, api_key="sk-test"), prompts)
    assert seen[-1]["model"] == "fake-model"   # taken from /v1/models
    assert seen[-1]["ignore_eos"] is True and seen[-1]["_auth"] == "Bearer sk-test"
    assert seen[-1]["stream"] is True and seen[-1]["stream_options"]["include_usage"] is True
    a = aggregate(recs)
    assert (a["completed"], a["failed"]) == (4, 0)
    assert [r.output_tokens for r in recs] == [5] * 4 and a["total_output_tokens"] == 20
    assert a["total_input_tokens"] == 48
    assert all(len(r.chunk_times) == 5 and r.send < r.chunk_times[0] <= r.end for r in recs)
    # sleeps only make things later, so only lower bounds are wall-clock facts (a loaded CI
    # machine stretched one TTFT to 1.45 s); the means are checked against the records instead
    assert all(ttft(r) >= FIRST_DELAY - 0.005 for r in recs)
    assert all(tpot(r) >= GAP - 0.04 for r in recs)
    assert all(e2e(r) >= FIRST_DELAY + 4 * GAP - 0.01 for r in recs)
    assert a["ttft"]["mean_ms"] == pytest.approx(1e3 * np.mean([ttft(r) for r in recs]))
    assert a["tpot"]["mean_ms"] == pytest.approx(1e3 * np.mean([tpot(r) for r in recs]))
    assert a["itl"]["mean_ms"] == pytest.approx(1e3 * np.mean([g for r in recs for g in itls(r)]))
    assert a["e2el"]["mean_ms"] == pytest.approx(1e3 * np.mean([e2e(r) for r in recs]))
    assert a["output_throughput"] == pytest.approx(20 / a["duration_s"])


def test_chat_and_usage_fallback(server):
    url, _ = server
    prompts = random_dataset(2, 6, 3, 0.0, seed=0, text=True)
    a = aggregate(run(BenchConfig(base_url=url, endpoint=CHAT, model="no-usage"), prompts))
    assert a["completed"] == 2 and a["total_output_tokens"] == 6   # counted chunks
    assert a["total_input_tokens"] == 12                             # dataset estimate
    assert a["ttft"]["mean_ms"] / 1e3 >= FIRST_DELAY - 0.005        # role-only event skipped


def test_concurrency_limit_serializes(server):
    url, _ = server
    recs = run(BenchConfig(base_url=url, model="fake-model", max_concurrency=1),
               random_dataset(3, 4, 2, 0.0, seed=0))
    spans = sorted((r.send, r.end) for r in recs)
    assert all(r.success for r in recs)
    assert all(nxt[0] >= cur[1] for cur, nxt in zip(spans, spans[1:]))   # never overlapping


def test_poisson_schedule_is_respected(server):
    url, _ = server
    prompts = random_dataset(5, 4, 1, 0.0, seed=0)
    recs = run(BenchConfig(base_url=url, model="fake-model", seed=9), prompts, rate=20.0)
    offsets = arrival_times(5, 20.0, seed=9)
    assert all(r.success and r.send >= t - 0.002 for r, t in zip(recs, offsets))
    assert all(tpot(r) is None for r in recs)   # one token each


def test_failures_are_counted(server):
    url, _ = server
    rejected = run(BenchConfig(base_url=url, model="fake-model"),
                   [Prompt([3, 4], 2, REJECT_ABOVE + 1)] * 2)
    a = aggregate(rejected)
    assert (a["completed"], a["failed"]) == (0, 2) and a["ttft"]["mean_ms"] is None
    assert a["errors"][0].startswith("RuntimeError: HTTP 400")
    cut = aggregate(run(BenchConfig(base_url=url, model="truncate"), [Prompt([3], 1, 2)]))
    assert cut["failed"] == 1 and "[DONE]" in cut["errors"][0]
    slow = aggregate(run(BenchConfig(base_url=url, model="fake-model", timeout=0.05),
                         [Prompt([3], 1, 2)]))
    assert slow["failed"] == 1 and "timeout" in slow["errors"][0]


def test_cli_sweep_writes_json_and_plot(server, tmp_path, capsys):
    url, _ = server
    out, png = tmp_path / "r.json", tmp_path / "s.png"
    main(["--base-url", url, "--num-prompts", "3", "--random-input-len", "5",
          "--random-output-len", "2", "--sweep", "inf,50", "--plot", str(png),
          "--result-json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "serve" and doc["command"].startswith("python -m benchmarks.serving.serve")
    assert doc["machine"]["versions"]["python"] and doc["ratio"] is None
    assert doc["config"]["request_rate"] == "inf"
    report = doc["results"]
    assert [r["request_rate"] for r in report["runs"]] == ["inf", "50.0"]
    assert all(r["metrics"]["completed"] == 3 and len(r["requests"]) == 3 for r in report["runs"])
    assert report["runs"][0]["requests"][0]["output_tokens"] == 2
    assert_figure(png)
    text = capsys.readouterr().out
    assert "Mean TTFT (ms)" in text and text.count("| inf |") == 1
    assert format_sweep_table([]).count("\n") == 1


def test_cli_output_dir_writes_the_shared_files(server, tmp_path, monkeypatch):
    url, _ = server
    monkeypatch.chdir(tmp_path)   # where a default serve_sweep.png would land
    main(["--base-url", url, "--num-prompts", "2", "--random-input-len", "5",
          "--random-output-len", "2", "--sweep", "inf,50", "--output-dir", str(tmp_path),
          "--name", "one"])
    doc = json.loads((tmp_path / "one.json").read_text())
    assert [r["metrics"]["completed"] for r in doc["results"]["runs"]] == [2, 2]
    assert_figure(tmp_path / "one.png")
    assert "| inf | 2 | 0 |" in (tmp_path / "one.md").read_text()
    assert not (tmp_path / "serve_sweep.png").exists()


def test_cli_without_matplotlib_writes_results_and_warns(server, tmp_path, capsys, monkeypatch):
    url, _ = server
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # as if not installed
    out, png = tmp_path / "r.json", tmp_path / "s.png"
    main(["--base-url", url, "--num-prompts", "2", "--random-input-len", "5",
          "--random-output-len", "2", "--sweep", "inf", "--plot", str(png),
          "--result-json", str(out), "--output-dir", str(tmp_path), "--name", "two"])
    assert json.loads(out.read_text())["results"]["runs"][0]["metrics"]["completed"] == 2
    assert json.loads((tmp_path / "two.json").read_text())["benchmark"] == "serve"
    assert "| inf | 2 | 0 |" in (tmp_path / "two.md").read_text()
    assert not png.exists() and not (tmp_path / "two.png").exists()
    err = capsys.readouterr().err
    for figure in (png, tmp_path / "two.png"):
        assert f"WARNING: plot {figure} not drawn: matplotlib is not installed" in err
    assert 'pip install -e ".[bench]"' in err
