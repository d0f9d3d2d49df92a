"""Through HTTP, every prompt is checked exactly once (the input processor's counts, as
/metrics shows them), whatever the endpoint, n or streaming; a refusal is a 400
whose param the processor named."""
from __future__ import annotations

import re

import httpx
import pytest

from tests.api.conftest import API_KEY, Server


def counts(server: Server) -> tuple[int, int]:
    """(accepted, refused) engine requests so far."""
    text = httpx.get(server.url + "/metrics").text

    def gauge(name: str) -> int:
        m = re.search(rf"^jaxserve:{name}{{[^}}]*}} (\S+)$", text, re.M)
        assert m, f"{name} missing from /metrics"
        return int(float(m.group(1)))
    return gauge("num_requests_processed"), gauge("num_requests_refused")


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"})


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, num_prompts", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}, 1),
    ("/v1/completions", {"prompt": ["Hello", [5, 6, 7]], "n": 2, "max_tokens": 2,
                         "temperature": 1.0, "seed": 1}, 2),
    ("/v1/completions", {"prompt": [[5, 6], [7, 8], [9]], "n": 3, "max_tokens": 2,
                         "stream": True, "temperature": 1.0}, 3),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}, 1),
    ("/v1/chat/completions", {"messages": CHAT, "n": 3, "max_tokens": 2,
                              "temperature": 1.0}, 1),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2, "max_tokens": 2, "stream": True,
                              "temperature": 1.0}, 1),
])
def test_each_prompt_is_processed_exactly_once(server, path, body, num_prompts):
    accepted, refused = counts(server)
    resp = post(server, path, body)
    assert resp.status_code == 200, resp.text
    assert counts(server) == (accepted + num_prompts, refused)


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": []}, "prompt", "prompt must not be empty"),
    ({"prompt": ""}, "prompt", "prompt must not be empty"),
    ({"prompt": [[5], []]}, "prompt", "prompt must not be empty"),
    ({"prompt": [5] * 200}, "prompt", "max_model_len"),
    ({"prompt": [5, 6], "max_tokens": 1000}, "max_tokens", "cannot fit"),
])
def test_a_refusal_is_counted_once_and_names_its_field(server, body, param, message):
    accepted, refused = counts(server)
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and message in err["message"]
    # The prompts before the refused one passed the door (and were never run).
    passed = 1 if body["prompt"] == [[5], []] else 0
    assert counts(server) == (accepted + passed, refused + 1)
