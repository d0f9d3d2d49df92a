"""No request can crash, freeze or flood the server (issue 37): malformed shapes are 400s
naming their field, outsized bodies are refused by their bounds while /health answers,
the API key is checked before the body is read, error messages and log lines are
bounded, and token ids are ASCII digits. The shared `server` (tests/api/conftest.py)
for what needs a real process; the in-process app with a stub engine for the logs."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from jaxserve.api import unsupported
from jaxserve.api.body_limit import MAX_BODY_JSON_FIELDS, MAX_BODY_JSON_VALUES
from jaxserve.api.errors import MAX_ERROR_MESSAGE_CHARS, error_body
from jaxserve.api.internal_errors import InternalErrors
from jaxserve.api.server import create_app
from jaxserve.api.settings import ServerSettings
from jaxserve.json_limits import MAX_JSON_DEPTH
from tests.api.conftest import API_KEY, Server
from tests.api.test_admission import StubEngine, call

AUTH = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
CHAT = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
DEEP = "[" * 100_000 + "]" * 100_000


def post(srv: Server, path: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(srv.url + path, content=content, timeout=120,
                      headers=AUTH if headers is None else headers)


def error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text[:500]
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


# ---- 1. shapes that used to be 500s ------------------------------------------------------
@pytest.mark.parametrize("body, param, words", [
    ({"messages": 5}, "messages", "list"),
    ({"messages": True}, "messages", "list"),
    ({"messages": CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": [1]}},
     "tool_choice", "tool_choice"),
    # JSON text 100k levels deep in a tool call's arguments (json.loads would recurse)
    ({"messages": [*CHAT, {"role": "assistant", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": DEEP}}]}]},
     "messages", "MAX_JSON_DEPTH"),
    ({"messages": CHAT, "guided_json": DEEP}, "guided_json", "MAX_JSON_DEPTH"),
], ids=["messages-int", "messages-bool", "tool_choice-function-list", "deep-arguments",
        "deep-guided-json"])
def test_malformed_shapes_are_400s_naming_the_field(server, body, param, words):
    err = error(post(server, "/v1/chat/completions", {**body, "max_tokens": 2}), 400)
    assert err["param"] == param and words in err["message"]


def test_a_body_nested_too_deep_is_refused_before_parsing(server):
    err = error(post(server, "/v1/completions", '{"prompt": %s}' % DEEP), 400)
    assert "MAX_JSON_DEPTH" in err["message"] and str(MAX_JSON_DEPTH) in err["message"]
    fine = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)   # the bound itself passes
    assert "MAX_JSON_DEPTH" not in post(server, "/v1/completions",
                                        '{"prompt": "hi", "x": %s}' % fine).text


# ---- 2, 3. outsized bodies: refused by their bound, /health answers meanwhile ------------
def test_outsized_bodies_are_refused_by_their_bound_while_health_answers(server):
    ids = b"[" + b"5, " * 10_000_000 + b"5]"   # 30 MB
    fields = b", ".join(b'"f%d": 1' % i for i in range(250_000))
    payloads = [  # (path, body, the bound its 413 names)
        ("/detokenize", b'{"tokens": %s}' % ids, "MAX_BODY_JSON_VALUES"),
        ("/v1/completions", b'{"prompt": "hi", "allowed_token_ids": %s}' % ids,
         "MAX_BODY_JSON_VALUES"),
        ("/v1/completions", b'{"prompt": "hi", %s}' % fields, "MAX_BODY_JSON_FIELDS"),
    ]
    latencies: list[float] = []
    stop = threading.Event()

    def poll_health():
        while not stop.is_set():
            t0 = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=60).status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.02)

    log_before = len(server.output())
    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        for path, payload, bound in payloads:
            err = error(post(server, path, payload), 413)
            limit = MAX_BODY_JSON_VALUES if bound.endswith("VALUES") else MAX_BODY_JSON_FIELDS
            assert bound in err["message"] and str(limit) in err["message"]
    finally:
        stop.set()
        poller.join()
    print(f"\noutsized bodies: {len(latencies)} /health calls meanwhile, slowest "
          f"{max(latencies) * 1000:.0f} ms")
    # (it took 9-15 s to parse each: the event loop answered nothing meanwhile)
    assert latencies and max(latencies) < 2.0, max(latencies)
    # nothing of the bodies reached the log (250k unknown fields made 250k lines)
    assert len(server.output()) - log_before < 10_000


def test_a_million_prompts_are_refused_before_any_is_processed(server):
    err = error(post(server, "/v1/completions", {"prompt": ["a"] * 500_000}), 400)
    assert err["param"] == "n" and "--max-waiting-requests" in err["message"]


@pytest.mark.parametrize("field", ["allowed_token_ids", "stop_token_ids"])
def test_token_id_lists_are_bounded(server, field):
    err = error(post(server, "/v1/completions", {"prompt": "hi", field: [5] * 300_000}), 400)
    assert err["param"] == field and "MAX_TOKEN_ID_LIST" in err["message"]
    assert len(err["message"]) < 300   # the value is shown by its start


# ---- 2, 3. log lines: bounded, one per request ------------------------------------------
@pytest.fixture
def logging_app(caplog):
    caplog.set_level(logging.INFO, logger="jaxserve")
    return create_app(StubEngine(), ServerSettings(served_model_names=("stub",),
                                                   max_model_len=64, max_log_len=200))


def records(caplog, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if words in r.getMessage()]


def test_the_request_log_line_is_bounded(logging_app, caplog):
    call(logging_app, {"prompt": [5, 6], "max_tokens": 1, "allowed_token_ids": [5] * 200_000,
                       "stop": ["x" * 100_000]}, hang_up=False)
    [line] = records(caplog, "request cmpl-")
    assert "allowed_token_ids=[5, 5," in line and len(line) < 30 * 200   # 30 fields at most


def test_unknown_fields_make_one_bounded_line_per_request_and_bounded_memory(
        logging_app, caplog):
    many = {f"unknown_{i}": 1 for i in range(MAX_BODY_JSON_FIELDS // 2)}
    call(logging_app, {"prompt": [5, 6], "max_tokens": 1, **many}, hang_up=False)
    [line] = records(caplog, "ignored, as jaxserve does not implement them")
    assert "'unknown_0' (unknown)" in line and f"and {len(many) - 10} more" in line
    assert len(line) < 2000
    assert len(unsupported._logged) <= unsupported._MAX_REMEMBERED
    caplog.clear()   # names already logged are not logged again
    call(logging_app, {"prompt": [5, 6], "max_tokens": 1, "unknown_0": 1}, hang_up=False)
    assert not records(caplog, "ignored, as jaxserve")


# ---- 4. the API key, before the body ---------------------------------------------------
def test_the_api_key_is_checked_before_the_body_is_read(server):
    # Headers announcing 10 MB, and no body: the answer cannot wait for it (a socket
    # timeout, on a server that reads the body first).
    for auth in (b"", b"Authorization: Bearer wrong\r\n"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\n" + auth + b"Content-Length: 10000000\r\n\r\n")
            answer = b""
            while chunk := s.recv(65536):   # the server closes after the answer
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401"), head
        assert json.loads(body)["error"]["type"] == "AuthenticationError"


def test_open_routes_stay_open_and_the_schema_shows_the_key(server):
    for path in ("/health", "/ping", "/load", "/metrics", "/version", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 200, path
    error(httpx.post(server.url + "/v1/completions", json={"prompt": "x"}), 401)
    error(httpx.get(server.url + "/v1/models", headers={"Authorization": "Basic x"}), 401)
    schema = httpx.get(server.url + "/openapi.json").json()
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert schema["paths"]["/v1/completions"]["post"]["security"] == [{"HTTPBearer": []}]
    assert "security" not in schema["paths"]["/health"]["get"]


# ---- 5. error messages: bounded, no panics ---------------------------------------------
def test_an_error_quoting_a_huge_value_is_bounded(server):
    resp = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                            "response_format": {"type": "x" * 1_400_000}})
    err = error(resp, 400)
    assert err["param"] == "response_format" and err["message"].startswith("response_format")
    assert len(err["message"]) <= MAX_ERROR_MESSAGE_CHARS
    assert err["message"].endswith(" characters)")   # how long the whole was


def test_a_panic_or_backtrace_never_reaches_the_client(caplog):
    panic = ("invalid structured_outputs grammar: panic: index out of bounds: the len is 3 "
             "but the index is 7\n   0: llguidance::earley::parser::Parser::scan\n"
             "             at /root/.cargo/registry/src/parser.rs:812:9\n   1: rust_begin_unwind")
    traceback = "bad thing\nTraceback (most recent call last):\n  File \"x.py\", line 1"
    for text, kept in ((panic, "invalid structured_outputs grammar"), (traceback, "bad thing")):
        message = error_body(400, text)["error"]["message"]
        assert message.startswith(kept) and "the server log has it" in message
        assert "panic" not in message and "llguidance::" not in message \
            and "Traceback" not in message
    assert any("parser.rs" in r.getMessage() for r in caplog.records)   # the operator's


def test_a_panic_in_a_route_is_one_500_that_does_not_show_it(caplog):
    panic_type = type("PanicException", (BaseException,), {})   # as pyo3 makes it

    async def route(scope, receive, send):
        raise panic_type("assertion failed: mid > len\nstack backtrace:\n   0: rust_panic")

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    asyncio.run(InternalErrors(route)({"type": "http", "path": "/v1/completions"}, None, send))
    assert sent[0]["status"] == 500
    message = json.loads(sent[1]["body"])["error"]["message"]
    assert message.startswith("internal error") and "panicked" in message
    assert "mid > len" not in message and "rust_panic" not in message
    assert any("rust_panic" in r.getMessage() for r in caplog.records)   # the log has it


# ---- 6. token ids are ASCII digits -------------------------------------------------------
@pytest.mark.parametrize("key", ["\u0663", "\u00b3", "3 ", "+3", "3_0", "9" * 5000])
def test_logit_bias_keys_are_ascii_decimal_token_ids(server, key):
    err = error(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                 "logit_bias": {key: 100}}), 400)
    assert err["param"] == "logit_bias" and "not a token id" in err["message"]
    assert len(err["message"]) < 200
    ok = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                          "logit_bias": {"03": 100}})
    assert ok.status_code == 200, ok.text
