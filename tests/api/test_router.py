"""Scale-out with an existing router: vLLM's router (vllm-router) in front of two
jaxserve servers on 127.0.0.1 (the session's two servers of the same model), with its
consistent-hash policy: requests through it reach both servers, and a repeated prompt
goes back to the server that has its pages cached (the prefix-cache hits show it).

(Its cache_aware policy, the default, sent every request to one of the two servers in
this test with vllm-router 0.1.17: it asks each server for POST /v1/completions/render,
which jaxserve does not serve (404), then falls back to /tokenize.)"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from tests.api.conftest import API_KEY, free_port
from tests.api.test_metrics_vllm import samples, value

BESIDE = os.path.join(os.path.dirname(sys.executable), "vllm-router")
ROUTER = BESIDE if os.path.isfile(BESIDE) else shutil.which("vllm-router")


@pytest.fixture(scope="module")
def router(server, tool_server, tmp_path_factory):
    assert ROUTER, "vllm-router is not installed (pip install -e '.[test]')"
    port = free_port()
    log = open(tmp_path_factory.mktemp("router") / "router.log", "w+")
    proc = subprocess.Popen(
        [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", "consistent_hash",
         "--worker-urls", server.url, tool_server.url, "--prometheus-port", str(free_port()),
         "--log-level", "warning", "--worker-startup-timeout-secs", "60"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.seek(0) or log.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log.seek(0) or log.read()
        time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=10)
    log.close()


def test_router_spreads_prompts_and_keeps_prefixes_where_they_are_cached(
        router, server, tool_server, api_checkpoint):
    servers = (server, tool_server)

    def snap() -> list[dict]:
        return [samples(httpx.get(s.url + "/metrics").text) for s in servers]

    # Sixteen unrelated prompts of several pages each; then each again.
    prompts = [f"router {i}: " + " ".join(f"w{i}x{j}" for j in range(12)) for i in range(16)]
    snaps = [snap()]
    with httpx.Client(base_url=router, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        for _ in range(2):
            for p in prompts:
                r = client.post("/v1/completions", json={"model": api_checkpoint, "prompt": p,
                                                         "max_tokens": 2, "ignore_eos": True})
                assert r.status_code == 200, r.text
            snaps.append(snap())

    def grew(name: str, rnd: int, i: int | None = None) -> float:
        return sum(value(snaps[rnd + 1][k], name) - value(snaps[rnd][k], name)
                   for k in ((0, 1) if i is None else (i,)))

    served = [grew("vllm:request_success_total", 0, i) + grew("vllm:request_success_total", 1, i)
              for i in range(2)]
    assert sum(served) == 32 and min(served) >= 2, served   # both servers take work
    # The first time, the prompts share less than a page; the second time each finds
    # its full pages where it went first.
    first, again = (grew("vllm:prefix_cache_hits_total", r) /
                    grew("vllm:prefix_cache_queries_total", r) for r in (0, 1))
    assert first < 0.2 and again > 0.6, (first, again)
