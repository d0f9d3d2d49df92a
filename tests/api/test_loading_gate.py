"""LoadingGate in-process: what the server answers while the engine is being built, and
that it hands everything to the real app (and stops the engine) once it has one."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
from fastapi import FastAPI

from jaxserve.api.loading import LoadingGate
from jaxserve.api.metrics import Metrics
from jaxserve.build.startup import COMPILING, StartupProgress


class FakeEngine:
    def __init__(self):
        self.shutdowns = 0

    def shutdown(self):
        self.shutdowns += 1


def real_app() -> FastAPI:
    app = FastAPI()
    app.state.serving = SimpleNamespace(name="serving")

    @app.get("/health")
    async def health():
        return {"from": "real app"}
    return app


def get(gate: LoadingGate, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate),
                                     base_url="http://test") as c:
            return await c.request(method, path, **kw)
    return asyncio.run(go())


def lifespan_shutdown(gate: LoadingGate) -> list[str]:
    """Runs the ASGI lifespan (startup, then shutdown); returns what the gate sent."""
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message["type"])
    asyncio.run(gate({"type": "lifespan"}, receive, send))
    return sent


def make_gate() -> LoadingGate:
    progress = StartupProgress()
    progress.set_phase(COMPILING, "", total=19)
    progress.advance(11, 19, "compiling program 12 of 19")
    return LoadingGate(progress, Metrics("m"), "1.2.3")


def test_while_loading():
    gate = make_gate()
    health = get(gate, "GET", "/health")
    assert health.status_code == 503 and health.headers["retry-after"]
    body = health.json()
    assert (body["status"], body["phase"], body["detail"], body["done"], body["total"]) == (
        "loading", "compiling", "compiling program 12 of 19", 11, 19)
    assert body["seconds"] >= 0
    for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/models"), ("POST", "/tokenize")]:
        r = get(gate, method, path, json={})
        assert r.status_code == 503, path
        err = r.json()["error"]
        assert err["code"] == 503 and err["type"] == "ServiceUnavailableError"
        assert "still loading" in err["message"] and "program 12 of 19" in err["message"]
    assert get(gate, "GET", "/version").json() == {"version": "1.2.3"}
    metrics = get(gate, "GET", "/metrics")
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
    assert gate.serving is None


def test_failed_build_is_reported():
    gate = make_gate()
    gate.fail(ValueError("no config.json"))
    body = get(gate, "GET", "/health").json()
    assert (body["status"], body["phase"]) == ("failed", "failed")
    assert "ValueError: no config.json" in body["detail"]
    err = get(gate, "POST", "/v1/completions", json={}).json()["error"]
    assert "failed to start" in err["message"]


def test_once_open_the_real_app_answers_and_shutdown_stops_the_engine():
    gate, engine, app = make_gate(), FakeEngine(), real_app()
    gate.open(app, engine)
    assert get(gate, "GET", "/health").json() == {"from": "real app"}
    assert gate.serving is app.state.serving
    assert lifespan_shutdown(gate) == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert engine.shutdowns == 1


def test_an_engine_built_after_shutdown_is_stopped_at_once():
    gate, engine = make_gate(), FakeEngine()
    lifespan_shutdown(gate)
    gate.open(real_app(), engine)
    assert engine.shutdowns == 1
