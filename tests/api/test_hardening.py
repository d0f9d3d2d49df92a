"""No request can kill, freeze or exhaust the server: one real uvicorn process, driven
as a hostile client would (raw JSON, raw sockets, hang-ups, SIGTERM mid-stream)."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import sys
import threading
import time

import httpx
import pytest

from tests.api.conftest import Server, metric, wait_for
from tests.checkpoints import make_tiny_checkpoint

VOCAB = 256          # the tiny checkpoint's vocabulary
MAX_MODEL_LEN = 4096
BODY_CAP = 2**20
MAX_WAITING = 64
MAX_NUM_SEQS = 8
# A template that refuses system messages, as some real ones do (raise_exception).
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
            "{{ raise_exception('this template takes no system message') }}{% endif %}"
            "<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def hard(tmp_path_factory):
    """A server with a long context (so a generation outlives a hang-up by seconds),
    a 1 MiB body cap, 64 waiting sequences and a 3 s grace period."""
    root = tmp_path_factory.mktemp("hard")
    model = make_tiny_checkpoint("qwen3", root / "qwen3", max_position_embeddings=MAX_MODEL_LEN)
    template = root / "template.jinja"
    template.write_text(TEMPLATE)
    srv = Server(model, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs",
                 str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING),
                 "--max-request-body-bytes", str(BODY_CAP), "--timeout-graceful-shutdown", "3",
                 "--chat-template", str(template), api_key=None)
    yield srv
    srv.stop()


def post(srv: Server, path: str, body, timeout: float = 60) -> httpx.Response:
    """Raw JSON (NaN and lone-surrogate escapes included) unless body is a dict."""
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(srv.url + path, content=content, timeout=timeout,
                      headers={"content-type": "application/json"})


def error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def idle(srv: Server) -> bool:
    return all(metric(srv, m) == 0 for m in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "jaxserve:num_sequences_admitted"))


def assert_serves(srv: Server) -> None:
    assert httpx.get(srv.url + "/health").status_code == 200
    ok = post(srv, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 3


def raw_request(srv: Server, body: dict) -> socket.socket:
    """Sends a POST /v1/completions on a bare socket and returns it unread."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


# ---- 1. integers that would overflow a device array ------------------------------------
@pytest.mark.parametrize("field, body", [
    ("top_k", {"top_k": 2**40, "temperature": 1.0}),
    ("stop_token_ids", {"stop_token_ids": [2**40]}),
    ("stop_token_ids", {"stop_token_ids": [VOCAB]}),
    ("min_tokens", {"stop_token_ids": [3], "min_tokens": 2**40}),
    ("prompt", {"prompt": [5, 2**40]}),
    ("prompt", {"prompt": [5, VOCAB]}),
    ("seed", {"seed": 2**64}),
    ("priority", {"priority": 2**64}),
    ("logprobs", {"logprobs": 2**40}),
    ("max_tokens", {"max_tokens": 2**40}),
    ("n", {"n": 2**40}),
])
def test_out_of_range_integers_are_refused_and_the_engine_lives(hard, field, body):
    resp = post(hard, "/v1/completions", {"prompt": "hello", "max_tokens": 2, **body})
    assert error(resp, 400)["param"] == field
    assert_serves(hard)


def test_chat_top_logprobs_out_of_range(hard):
    resp = post(hard, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
        "top_logprobs": 2**40, "max_tokens": 2})
    assert error(resp, 400)["param"] == "top_logprobs"
    assert_serves(hard)


# ---- 2. n is capped and every sequence counts against admission ----------------------------
def test_n_is_capped(hard):
    assert error(post(hard, "/v1/completions", {"prompt": "hi", "n": 129}), 400)["param"] == "n"
    # More sequences than the server ever admits at once: refused, not queued for ever.
    too_many = post(hard, "/v1/completions", {"prompt": ["a", "b"], "n": MAX_WAITING // 2 + 1,
                                              "max_tokens": 1})
    assert "sequences" in error(too_many, 400)["message"]
    ok = post(hard, "/v1/completions", {"prompt": [5, 6], "n": MAX_WAITING, "max_tokens": 1,
                                        "temperature": 1.0})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == MAX_WAITING


def test_admission_counts_sequences_not_requests(hard):
    """MAX_NUM_SEQS long requests run; then requests of n = MAX_WAITING / 2 sequences
    each: two fit in the waiting room, the third is a 503."""
    long = {"prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    runners = [raw_request(hard, long) for _ in range(MAX_NUM_SEQS)]
    try:
        wait_for(lambda: metric(hard, "vllm:num_requests_running") == MAX_NUM_SEQS, 30)
        group = {"prompt": [9, 8, 7], "n": MAX_WAITING // 2, "max_tokens": 2000,
                 "ignore_eos": True, "temperature": 1.0, "stream": True}
        waiting = [raw_request(hard, group) for _ in range(2)]
        wait_for(lambda: metric(hard, "jaxserve:num_sequences_admitted")
                 == MAX_NUM_SEQS + MAX_WAITING, 10)
        third = post(hard, "/v1/completions", {**group, "stream": False})
        assert "overloaded" in error(third, 503)["message"]
        for s in waiting:
            s.close()
    finally:
        for s in runners:
            s.close()
    wait_for(lambda: idle(hard), 20)


# ---- 3. a non-streaming client that hangs up is aborted -----------------------------------
def test_non_streaming_client_that_hangs_up_is_aborted(hard):
    s = raw_request(hard, {"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True})
    wait_for(lambda: metric(hard, "vllm:num_requests_running") == 1, 30)
    s.close()
    # 4000 tokens take far longer than this; the abort lands within the poll interval.
    print(f"\nnon-streaming hang-up: idle {wait_for(lambda: idle(hard), 3):.2f} s later")
    assert_serves(hard)


# ---- 4. big inputs are refused by size, and do not freeze the event loop ------------------
def test_big_bodies_and_prompts_are_refused_without_freezing(hard):
    latencies: list[float] = []
    stop = threading.Event()

    def poll_health():
        while not stop.is_set():
            t0 = time.monotonic()
            assert httpx.get(hard.url + "/health", timeout=30).status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.02)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        t0 = time.monotonic()
        big = post(hard, "/v1/completions", {"prompt": "a" * (8 * BODY_CAP)})
        assert "--max-request-body-bytes" in error(big, 413)["message"]
        # Under the body cap, but more characters than max_model_len tokens can hold.
        long = post(hard, "/v1/completions", {"prompt": "ab " * (BODY_CAP // 4)})
        assert "characters" in error(long, 400)["message"]
        chat = post(hard, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "ab " * (BODY_CAP // 4)}]})
        assert "characters" in error(chat, 400)["message"]
        assert time.monotonic() - t0 < 10
    finally:
        stop.set()
        poller.join()
    print(f"\nbig inputs: {len(latencies)} /health calls meanwhile, slowest "
          f"{max(latencies) * 1000:.0f} ms")
    assert latencies and max(latencies) < 1.0, max(latencies)
    assert_serves(hard)


# ---- 5. non-finite floats -------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("temperature", "NaN"), ("temperature", "Infinity"), ("top_p", "NaN"), ("min_p", "NaN"),
    ("presence_penalty", "-Infinity"), ("frequency_penalty", "NaN"),
    ("repetition_penalty", "Infinity"),
])
def test_non_finite_floats_are_refused(hard, field, value):
    body = '{"prompt": "hi", "max_tokens": 2, "%s": %s}' % (field, value)
    assert error(post(hard, "/v1/completions", body), 400)["param"] == field
    chat = ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "%s": %s}'
            % (field, value))
    assert error(post(hard, "/v1/chat/completions", chat), 400)["param"] == field


# ---- 6. invalid Unicode, clashing template arguments, a template that raises ----------------
LONE = "a\\ud800b"   # a JSON escape for a lone surrogate


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", '{"prompt": "%s", "max_tokens": 2}' % LONE),
    ("/v1/completions", '{"prompt": ["ok", "%s"], "max_tokens": 2}' % LONE),
    ("/v1/completions", '{"prompt": "hi", "stop": ["%s"], "max_tokens": 2}' % LONE),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "%s"}]}' % LONE),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}' % LONE),
    ("/v1/chat/completions", '{"messages": [{"role": "%s", "content": "hi"}]}' % LONE),
    ("/tokenize", '{"prompt": "%s"}' % LONE),
    ("/tokenize", '{"messages": [{"role": "user", "content": "%s"}]}' % LONE),
])
def test_invalid_unicode_is_a_400(hard, path, body):
    assert "Unicode" in error(post(hard, path, body), 400)["message"]


@pytest.mark.parametrize("kwargs", [{"tokenize": False}, {"return_dict": True},
                                    {"messages": []}, {"chat_template": "x"},
                                    {"add_generation_prompt": False}])
def test_clashing_template_kwargs_are_a_400(hard, kwargs):
    resp = post(hard, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template_kwargs": kwargs})
    err = error(resp, 400)
    assert err["param"] == "chat_template_kwargs" and next(iter(kwargs)) in err["message"]


def test_a_template_that_raises_is_a_400(hard):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for path in ("/v1/chat/completions", "/tokenize"):
        err = error(post(hard, path, {"messages": messages, "max_tokens": 2}), 400)
        assert "no system message" in err["message"] and err["param"] == "messages"
    assert_serves(hard)


# ---- 7. the smaller ones ----------------------------------------------------------------------
def test_max_completion_tokens_zero_is_refused(hard):
    resp = post(hard, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0})
    assert error(resp, 400)["param"] == "max_completion_tokens"


def test_framework_errors_have_the_openai_shape(hard):
    error(httpx.get(hard.url + "/no/such/path"), 404)
    wrong_method = httpx.get(hard.url + "/v1/completions")
    error(wrong_method, 405)
    assert "POST" in wrong_method.headers["allow"]


def test_openapi_schema_tells_the_truth(hard):
    schema = httpx.get(hard.url + "/openapi.json").json()
    assert '"422"' not in json.dumps(schema)
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "503"} <= set(completions)
    assert "text/event-stream" in completions["200"]["content"]
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == [httpx.get(hard.url + "/metrics").headers["content-type"]]


def test_many_clients_hanging_up_leave_nothing_behind(hard):
    """The fault test: 64 concurrent clients; a quarter leave before the first byte, a
    quarter mid-stream, a quarter leave non-streaming requests, a quarter stay."""
    base = {"max_tokens": 400, "ignore_eos": True, "temperature": 1.0}

    async def stays(c: httpx.AsyncClient, i: int) -> int:
        r = await c.post(hard.url + "/v1/completions", json={
            **base, "prompt": [5 + i % 50, 6], "max_tokens": 8 + i % 5, "seed": i})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8 + i % 5
        return 1

    async def leaves_mid_stream(c: httpx.AsyncClient, i: int) -> int:
        async with c.stream("POST", hard.url + "/v1/completions", json={
                **base, "prompt": [7 + i % 50, 8], "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break
        return 0

    async def leaves_at_once(i: int, stream: bool) -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", hard.port)
        data = json.dumps({**base, "prompt": [9 + i % 50], "stream": stream}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        await writer.drain()
        await asyncio.sleep(0 if stream else 0.3)   # non-streaming: leave mid-generation
        writer.close()
        return 0

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as c:
            jobs = []
            for i in range(64):
                kind = i % 4
                jobs.append(stays(c, i) if kind == 0 else leaves_mid_stream(c, i)
                            if kind == 1 else leaves_at_once(i, stream=kind == 2))
            return await asyncio.gather(*jobs)

    t0 = time.monotonic()
    assert sum(asyncio.run(run())) == 16
    drained = wait_for(lambda: idle(hard), 20)
    print(f"\nfault test: 64 clients (16 stayed, 48 left) in {time.monotonic() - t0:.1f} s; "
          f"idle {drained:.2f} s after the last one")
    assert_serves(hard)


# The CLI with a GBNF conversion (Python, in llguidance) that never ends on its own for
# one grammar, and no compile deadline: only a client leaving can stop it.
SPIN_GBNF = """
import sys
import llguidance._grammar_from as grammar_from, llguidance.gbnf_to_lark as gbnf_to_lark
from jaxserve.engine import grammar
grammar.COMPILE_TIMEOUT_S = 3600.0
convert = gbnf_to_lark.any_to_lark
def spin(text):
    while text.startswith('root ::= "spin"'):
        pass
    return convert(text)
gbnf_to_lark.any_to_lark = grammar_from.any_to_lark = spin
from jaxserve.cli.serve import main
main(sys.argv[1:])
"""


def test_slow_grammars_whose_clients_left_hold_up_nothing(api_checkpoint):
    """Eight clients send a grammar whose conversion never ends and hang up after a
    second. Their compiles stop (queued ones never start) and later requests, with a
    grammar or without, are answered: on the default thread pool the conversions filled
    it and a plain chat waited on them (74 s for conversions of 10 s each)."""
    srv = Server(api_checkpoint, api_key=None, launcher=(sys.executable, "-c", SPIN_GBNF))
    try:
        left: list[str] = []

        def leave() -> None:
            try:
                r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 2,
                                                  "guided_grammar": 'root ::= "spin"'},
                         timeout=1)
                left.append(f"answered {r.status_code}")
            except httpx.TimeoutException:
                left.append("left")

        clients = [threading.Thread(target=leave) for _ in range(8)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        assert left == ["left"] * 8, left
        chat = post(srv, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        choice = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 4,
                                                "guided_grammar": 'root ::= "yes" | "no"'})
        assert choice.status_code == 200 and choice.json()["choices"][0]["text"] in (
            "yes", "no"), choice.text
    finally:
        srv.stop()


def test_grammars_that_would_crash_or_fool_the_server_are_400s(hard):
    """A $ref chain that overflowed the compiler's stack (the process died), JSON text
    nested 30,000 deep (a RecursionError, 500), a regex llguidance echoed whole: 400s
    naming the field, in bounded messages; the server goes on."""
    defs = {f"{i:x}": {"$ref": f"#/$defs/{i + 1:x}"} for i in range(3000)}
    defs[f"{3000:x}"] = {"type": "integer"}
    chain = {"$ref": "#/$defs/0", "$defs": defs}
    for body, param, match in (
            ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": chain}}}, "response_format", "the limit is"),
            ({"guided_json": "[" * 30_000 + "]" * 30_000}, "guided_json", "MAX_JSON_DEPTH"),
            ({"guided_regex": "[" + "a" * 5000}, "guided_regex", "invalid regex")):
        err = error(post(hard, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}), 400)
        assert err["param"] == param and re.search(match, err["message"]), err
        assert len(err["message"]) < 300, err["message"]
    assert_serves(hard)


# ---- 1. defence in depth: an engine that cannot go on exits the process -------------------
# The CLI, with a runner whose device state is lost at the first step after warmup.
LOSE_DEVICE = """
import sys
from jaxserve.runner.model_runner import ModelRunner
def collect(self, step):
    raise RuntimeError("injected: the device went away")
ModelRunner.collect = collect
ModelRunner.device_state_ok = lambda self: False
from jaxserve.cli.serve import main
main(sys.argv[1:])
"""


def test_an_engine_that_cannot_go_on_exits_non_zero(api_checkpoint):
    srv = Server(api_checkpoint, api_key=None, launcher=(sys.executable, "-c", LOSE_DEVICE))
    try:
        resp = post(srv, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4})
        assert error(resp, 503)["message"].startswith("the engine stopped")
        assert srv.proc.wait(30) == 1, srv.output()   # a supervisor restarts it
        assert "the server exits with status 1" in srv.output()
    finally:
        srv.stop()


# ---- 7. SIGTERM: a stream that outlives the grace period ends cleanly (last: stops the server)
def test_sigterm_ends_streams_with_an_error_event_and_done(hard):
    lines: list[str] = []
    with httpx.stream("POST", hard.url + "/v1/completions", timeout=60, json={
            "prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 2:
                hard.proc.send_signal(signal.SIGTERM)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"]
    assert hard.proc.wait(30) == 0
