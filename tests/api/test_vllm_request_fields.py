"""vLLM's request limits and fields over HTTP: logprobs past the engine's max_logprobs
is a 400 naming the field and the limit (--max-logprobs raises it: the in-process
limit is tests/engine/test_llm_vllm_names.py); truncate_prompt_tokens keeps the
prompt's tail."""
from __future__ import annotations

import httpx

from tests.api.conftest import API_KEY

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _post(server, path: str, body: dict) -> httpx.Response:
    model = httpx.get(server.url + "/v1/models", headers=HEADERS).json()["data"][0]["id"]
    return httpx.post(server.url + path, json={"model": model, **body}, headers=HEADERS,
                      timeout=60)


def _error(resp: httpx.Response) -> dict:
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def test_logprobs_past_max_logprobs_is_a_400(server):
    err = _error(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                   "logprobs": 21}))
    assert err["param"] == "logprobs"
    assert "logprobs=21 is more than this engine's max_logprobs=20" in err["message"]
    err = _error(_post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 21}))
    assert "max_logprobs=20" in err["message"]
    ok = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 20})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 20


def test_truncate_prompt_tokens(server):
    body = {"prompt": list(range(5, 45)), "max_tokens": 2, "temperature": 0}
    full = _post(server, "/v1/completions", body).json()
    assert full["usage"]["prompt_tokens"] == 40
    cut = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 7}).json()
    tail = _post(server, "/v1/completions", {**body, "prompt": list(range(38, 45))}).json()
    assert cut["usage"]["prompt_tokens"] == 7
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]
    err = _error(_post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 0}))
    assert err["param"] == "truncate_prompt_tokens"
    chat = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello there, how are you?"}],
        "max_tokens": 2, "truncate_prompt_tokens": 3})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 3
