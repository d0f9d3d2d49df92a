"""The server's admission count (what --max-waiting-requests limits) always comes back
to zero, however a client leaves. In-process, with a stub engine: no model needed."""
from __future__ import annotations

import asyncio
import json

import pytest

from jaxserve.api.server import create_app
from jaxserve.api.settings import ServerSettings
from jaxserve.engine.async_engine import EngineStats
from jaxserve.engine.input_processor import InputProcessor


class StubEngine:
    """What the serving layer (and its stats line) asks of the engine before a request
    reaches it."""
    tokenizer = None
    stats = EngineStats()
    dead = False

    def __init__(self):
        self.generated = 0
        self.inputs = InputProcessor(tokenizer=None, vocab_size=100, max_model_len=64)

    async def generate(self, request):
        self.generated += 1
        raise RuntimeError("the stub runs no model")
        yield   # an async generator

    def shutdown(self):
        pass


def call(app, body: dict, *, hang_up: bool, method: str = "POST",
         path: str = "/v1/completions") -> list[dict]:
    """One ASGI request; with hang_up the client is gone as soon as it has sent it."""
    sent = []
    payload = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(payload)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    messages = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        if hang_up:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)

    async def send(message):
        await asyncio.sleep(0)   # a real socket write yields to the event loop
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("hang_up", [True, False])
def test_admission_is_released_however_the_client_leaves(stream, hang_up):
    # hang_up: the client is gone before the first byte of the answer (a stream's body
    # generator may never be pulled by the socket; the count must come back anyway).
    engine = StubEngine()
    app = create_app(engine, ServerSettings(served_model_names=("stub",), max_model_len=64,
                                            max_waiting_requests=2))
    serving = app.state.serving
    for _ in range(3):   # more than max_waiting_requests: a leak would show as a 503
        sent = call(app, {"prompt": [5, 6, 7], "max_tokens": 4, "stream": stream},
                    hang_up=hang_up)
        # (A stream whose client already left may send nothing at all.)
        assert all(m["status"] != 503 for m in sent if "status" in m)
        assert serving.num_in_flight == 0


def test_an_unexpected_error_is_one_500_and_is_not_raised_to_the_server(caplog):
    # The stub has no `config`, so /v1/models fails with an AttributeError: the answer
    # is an OpenAI-shaped 500, logged once, and nothing is re-raised to uvicorn (which
    # would log it again and drop the keep-alive connection).
    app = create_app(StubEngine(), ServerSettings(served_model_names=("stub",), max_model_len=64))
    sent = call(app, {}, hang_up=False, method="GET", path="/v1/models")
    assert sent[0]["status"] == 500
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == 500 and "AttributeError" in error["message"]
    assert sum("unhandled error" in r.getMessage() for r in caplog.records) == 1
