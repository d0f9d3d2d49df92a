"""The server with --async-scheduling (vLLM's flag): what its clients see is what the
in-order server (the shared `server`) answers: concurrent greedy streams, n > 1, stop
strings, logprobs and a client that leaves mid-stream, with nothing left running."""
from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest

from tests.api.conftest import API_KEY, Server, leave_mid_stream, metric, wait_for

PROMPTS = ["The capital of France is", "Once upon a time", [5, 6, 7, 8, 9], "1 2 3 4",
           "Hello", [11] * 40, "The quick brown fox", "A B C"]


@pytest.fixture(scope="module")
def async_server(api_checkpoint):
    srv = Server(api_checkpoint, "--enforce-eager", "--async-scheduling")
    yield srv
    srv.stop()


def client_of(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)


def completions(srv: Server, model: str, **kw) -> list[tuple[str, str, int]]:
    """All PROMPTS at once (streamed on odd indices): (text, finish reason, tokens) each."""
    client = client_of(srv)

    def one(i: int) -> tuple[str, str, int]:
        args = dict(model=model, prompt=PROMPTS[i], temperature=0, **kw)
        if i % 2:
            chunks = list(client.completions.create(
                **args, stream=True, stream_options={"include_usage": True}))
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
            return ("".join(c.choices[0].text for c in chunks if c.choices),
                    [r for r in reasons if r][-1], chunks[-1].usage.completion_tokens)
        out = client.completions.create(**args)
        return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens

    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


def test_the_server_says_its_steps_overlap(async_server):
    assert "async scheduling: on" in async_server.output()


def test_concurrent_greedy_streams_equal_the_in_order_server(async_server, server, api_checkpoint):
    got = completions(async_server, api_checkpoint, max_tokens=12)
    assert got == completions(server, api_checkpoint, max_tokens=12)
    assert all(n == 12 and reason == "length" for _, reason, n in got)


def test_stop_strings_and_eos_end_where_the_in_order_server_ends(async_server, server,
                                                                 api_checkpoint):
    # a stop string cut from each prompt's own continuation: it ends the request early
    full = completions(server, api_checkpoint, max_tokens=16)
    stop = [t[len(t) // 2:len(t) // 2 + 3] for t, _, _ in full if len(t) > 8][0]
    got = completions(async_server, api_checkpoint, max_tokens=16, stop=[stop])
    assert got == completions(server, api_checkpoint, max_tokens=16, stop=[stop])
    assert any(reason == "stop" for _, reason, _ in got)


def test_n_and_logprobs_equal_the_in_order_server(async_server, server, api_checkpoint):
    kw = dict(model=api_checkpoint, prompt="Hello there", n=3, max_tokens=6, temperature=0,
              logprobs=2)
    a, b = (client_of(s).completions.create(**kw) for s in (async_server, server))
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    for ca, cb in zip(a.choices, b.choices):
        assert ca.logprobs.tokens == cb.logprobs.tokens
        assert ca.logprobs.token_logprobs == pytest.approx(cb.logprobs.token_logprobs, abs=1e-4)


def test_a_client_that_leaves_mid_stream_leaves_nothing_running(async_server, api_checkpoint):
    leave_mid_stream(async_server, api_checkpoint)
    wait_for(lambda: metric(async_server, "vllm:num_requests_running") == 0, 30)
    wait_for(lambda: metric(async_server, "vllm:kv_cache_usage_perc") == 0, 30)
    # and it still answers
    out = client_of(async_server).completions.create(model=api_checkpoint, prompt="Hi",
                                                     max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
