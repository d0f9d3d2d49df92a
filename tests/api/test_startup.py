"""Cold start of a real `python -m jaxserve.api` (the built-in tiny model): the port
opens before the engine is ready and answers 503 with the startup phase, then 200.

Each server gets a fresh, empty compilation cache: its engine then takes seconds to
compile, so the first connection reliably lands before it is ready."""
from __future__ import annotations

import signal
import socket
import time

import httpx

from jaxserve.build import startup
from tests.api.conftest import Server

PHASES = {startup.STARTING, startup.LOADING_WEIGHTS, startup.ALLOCATING_KV_CACHE,
          startup.COMPILING}


def start_cold(tmp_path, *extra: str) -> Server:
    return Server(None, "--compilation-cache-dir", str(tmp_path / "xla"), *extra,
                  api_key=None, wait=False, log_dir=str(tmp_path))


def wait_for_port(srv: Server, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert srv.proc.poll() is None, srv.output()
        try:
            socket.create_connection(("127.0.0.1", srv.port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"the port never opened:\n{srv.output()}")


def test_health_is_503_with_the_phase_until_ready_then_it_serves(tmp_path):
    srv = start_cold(tmp_path)
    try:
        wait_for_port(srv)
        completion = httpx.post(srv.url + "/v1/completions", timeout=10,
                                json={"prompt": "hi", "max_tokens": 4})
        health = httpx.get(srv.url + "/health", timeout=10)
        # /health asked after the completion still loading: the completion was too.
        assert health.status_code == 503, health.text
        body = health.json()
        assert body["status"] == "loading" and body["phase"] in PHASES
        assert isinstance(body["seconds"], float) and body["detail"]
        assert completion.status_code == 503
        err = completion.json()["error"]
        assert err["code"] == 503 and "still loading" in err["message"]
        assert httpx.get(srv.url + "/version").status_code == 200

        seen = []
        deadline = time.monotonic() + 300
        while (r := httpx.get(srv.url + "/health", timeout=10)).status_code != 200:
            assert r.status_code == 503 and srv.proc.poll() is None, srv.output()
            seen.append(r.json())
            assert time.monotonic() < deadline, srv.output()
            time.sleep(0.1)
        compiling = [s for s in seen if s["phase"] == startup.COMPILING]
        # Before the first count the phase says it is listing its programs (no counts yet).
        listing = [s for s in compiling if s["total"] is None]
        assert all(s["done"] is None and s["detail"] == "listing the programs to compile"
                   for s in listing), seen
        assert compiling[:len(listing)] == listing, seen
        compiling = compiling[len(listing):]
        # Programs compiled so far, never past the total nor backwards; at the total, the
        # compiled programs run once each before the engine is ready.
        assert compiling and all(0 <= s["done"] <= s["total"] for s in compiling), seen
        assert [s["done"] for s in compiling] == sorted(s["done"] for s in compiling), seen
        assert all(s["detail"].startswith("compiled ") for s in compiling
                   if s["done"] == s["total"]), seen
        assert r.content == b""   # ready: today's empty 200

        done = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "prompt": "hi", "max_tokens": 4, "ignore_eos": True})
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] == 4
        assert "0 from the persistent compilation cache" in srv.output()
    finally:
        assert srv.stop() == 0, srv.output()


def test_sigterm_while_loading_exits_0(tmp_path):
    srv = start_cold(tmp_path)
    try:
        wait_for_port(srv)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.output()
        assert "stopped before the engine was ready" in srv.output()
    finally:
        srv.stop()


def test_an_engine_that_fails_to_build_exits_1(tmp_path):
    """The model directory exists (checked before listening) but its config is useless:
    that is found while building, after the port opened."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    srv = Server(str(bad), api_key=None, wait=False)
    assert srv.proc.wait(120) == 1, srv.output()
    out = srv.output()
    assert out.index("Uvicorn running on") < out.index("the engine failed to start (ValueError")
