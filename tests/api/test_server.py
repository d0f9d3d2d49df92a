"""The OpenAI-compatible server end to end, through the official openai client."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import httpx
import openai
import pytest

from jaxserve import LLM, SamplingParams
from tests.api.conftest import API_KEY, Server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_models_and_version(server, client, model, api_checkpoint):
    assert model == api_checkpoint
    assert httpx.get(server.url + "/version").json()["version"]


def test_completion_stream_equals_non_stream(client, model):
    kw = dict(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens > 0


def test_completion_n_logprobs_echo_and_token_prompts(client, model):
    out = client.completions.create(model=model, prompt=[[5, 6, 7, 8], "Hello"], n=2,
                                    max_tokens=5, temperature=1.0, seed=3, logprobs=2)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert out.usage.completion_tokens == 20
    echo = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                                     echo=True, logprobs=1)
    assert echo.choices[0].text.startswith("Hello")
    lp = echo.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == echo.usage.total_tokens


def test_seeded_sampling_is_reproducible(client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=42)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    c = client.completions.create(**{**kw, "seed": 7}).choices[0].text
    assert a == b and a != c


def test_stop_strings(client, model):
    kw = dict(model=model, prompt="Hello, my name is", max_tokens=30, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    stop = text[8:11]
    cut = client.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]
    streamed = "".join(c.choices[0].text for c in
                       client.completions.create(**kw, stop=[stop], stream=True) if c.choices)
    assert streamed == cut.text


def test_chat_matches_llm_chat(client, model, api_checkpoint):
    messages = [{"role": "user", "content": "hi there"}]
    resp = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                          temperature=0, logprobs=True, top_logprobs=2)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert len(choice.logprobs.content) == resp.usage.completion_tokens
    stream = list(client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        choice.message.content
    llm = LLM(api_checkpoint, dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64)
    ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert choice.message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_tokenize_detokenize(server):
    h = {"Authorization": f"Bearer {API_KEY}"}
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, headers=h).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    back = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}, headers=h)
    assert back.json()["prompt"].endswith("Hello world")


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_errors(server, model):
    h = {"Authorization": f"Bearer {API_KEY}"}
    url = server.url + "/v1/completions"
    post = lambda body, **kw: httpx.post(url, json=body, headers=kw.get("headers", h))  # noqa
    assert _error(post({"model": model, "prompt": "x", "temperature": -1}), 400)["param"] \
        == "temperature"
    assert _error(post({"model": model, "prompt": "x", "top_p": 2}), 400)["param"] == "top_p"
    assert _error(post({"model": model, "prompt": "x", "n": 0}), 400)["param"] == "n"
    assert _error(post({"model": model}), 400)["param"] == "prompt"
    assert "max_model_len" in _error(post({"model": model, "prompt": [5] * 200}), 400)["message"]
    assert _error(post({"model": model, "prompt": [5] * 100, "max_tokens": 50}), 400)
    assert _error(post({"model": model, "prompt": [999999]}), 400)
    bad_json = httpx.post(url, content=b'{"prompt": ', headers={**h, "content-type":
                                                                "application/json"})
    assert "JSON" in _error(bad_json, 400)["message"]
    assert _error(post({"model": "nope", "prompt": "x"}), 404)["param"] == "model"
    assert _error(post({"model": model, "prompt": "x"}, headers={}), 401)
    assert _error(post({"model": model, "prompt": "x"},
                       headers={"Authorization": "Bearer wrong"}), 401)
    chat = server.url + "/v1/chat/completions"
    assert _error(httpx.post(chat, json={"model": model, "messages": []}, headers=h), 400)
    # Open without a key.
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    # The server still serves after all that.
    assert post({"model": model, "prompt": "x", "max_tokens": 2}).status_code == 200


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_64_concurrent_streams(server, model):
    async def one(aclient, i):
        stream = await aclient.completions.create(
            model=model, prompt=[3 + i % 50, 7, 9], max_tokens=4 + i % 9, temperature=0.7,
            seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
        return i, usage

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY,
                                     max_retries=0)
        return await asyncio.gather(*(one(aclient, i) for i in range(64)))

    results = asyncio.run(run())
    assert len(results) == 64
    for i, usage in results:
        assert usage.completion_tokens == 4 + i % 9 and usage.prompt_tokens == 3
    assert _metric(server, "vllm:generation_tokens_total") > 0


def test_clients_hanging_up_free_everything(server, model):
    async def hang_up(i):
        async with httpx.AsyncClient(timeout=30) as c:
            async with c.stream("POST", server.url + "/v1/completions", headers={
                    "Authorization": f"Bearer {API_KEY}"}, json={
                    "model": model, "prompt": [5 + i, 6, 7], "max_tokens": 100,
                    "ignore_eos": True, "stream": True}) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        json.loads(line[6:])
                        break   # leave mid-stream

    async def run():
        await asyncio.gather(*(hang_up(i) for i in range(16)))

    asyncio.run(run())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (_metric(server, "vllm:num_requests_running") == 0
                and _metric(server, "vllm:kv_cache_usage_perc") == 0):
            break
        time.sleep(0.2)
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm:num_requests_waiting") == 0
    assert _metric(server, "vllm:kv_cache_usage_perc") == 0
    ok = httpx.post(server.url + "/v1/completions", headers={"Authorization":
                    f"Bearer {API_KEY}"}, json={"model": model, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_overload_503_and_sigterm_exit(api_checkpoint):
    srv = Server(api_checkpoint, "--max-waiting-requests", "2", "--max-num-seqs", "2",
                 api_key=None)
    try:
        async def flood():
            async with httpx.AsyncClient(timeout=60) as c:
                reqs = [c.post(srv.url + "/v1/completions", json={
                    "prompt": [5, 6, 7], "max_tokens": 60, "ignore_eos": True})
                    for _ in range(40)]
                return await asyncio.gather(*reqs)

        responses = asyncio.run(flood())
        codes = [r.status_code for r in responses]
        assert 503 in codes and 200 in codes and set(codes) == {200, 503}
        r503 = next(r for r in responses if r.status_code == 503)
        assert r503.headers.get("retry-after") and r503.json()["error"]["code"] == 503
        # SIGTERM while requests are in flight: exit 0 within the bound.
        async def busy():
            async with httpx.AsyncClient(timeout=60) as c:
                tasks = [asyncio.create_task(c.post(srv.url + "/v1/completions", json={
                    "prompt": [5, 6], "max_tokens": 100, "ignore_eos": True}))
                    for _ in range(2)]
                await asyncio.sleep(0.5)
                srv.proc.send_signal(signal.SIGTERM)
                await asyncio.gather(*tasks, return_exceptions=True)
        t0 = time.monotonic()
        asyncio.run(busy())
        assert srv.proc.wait(30) == 0, srv.output()
        assert time.monotonic() - t0 < 30
    finally:
        srv.stop()
