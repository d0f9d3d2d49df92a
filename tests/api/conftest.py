"""A real `python -m jaxserve.api` process on 127.0.0.1, driven by the openai client."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.checkpoints import make_tiny_checkpoint

API_KEY = "test-key"
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "16",
               "--max-num-batched-tokens", "64", "--disable-log-requests"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """launcher: the command before the flags (a test may start the CLI from a script
    that first patches something in). model None: the built-in tiny model (then give
    log_dir). wait: return once /health answers 200 (else see wait_ready). env: variables
    set for the server (over this process's)."""

    def __init__(self, model: str | None, *extra: str, api_key: str | None = API_KEY,
                 launcher: tuple[str, ...] = (sys.executable, "-m", "jaxserve.api"),
                 wait: bool = True, log_dir: str | None = None, https: bool = False,
                 env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"{'https' if https else 'http'}://127.0.0.1:{self.port}"
        self.verify = not https   # (a test's certificate is self-signed)
        model_args = ["--model", model] if model is not None else []
        args = [*launcher, *model_args, "--port", str(self.port), *SERVER_ARGS, *extra]
        if api_key:
            args += ["--api-key", api_key]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        env.pop("JAXSERVE_API_KEY", None)
        log_dir = log_dir or os.path.dirname(model)
        self.log = open(os.path.join(log_dir, f"server-{self.port}.log"), "w+")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1,
                             verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.proc.kill()
        raise RuntimeError(f"server did not start:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def metric(srv: Server, name: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def wait_for(cond, timeout: float) -> float:
    """Seconds until cond() held; fails after timeout."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached in time"
        time.sleep(0.05)
    return time.monotonic() - t0


def leave_mid_stream(srv: Server, model: str) -> None:
    """A streamed 100-token completion whose client hangs up after its first chunk."""
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": model, "prompt": [5, 6, 7], "max_tokens": 100,
                            "ignore_eos": True, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break


@pytest.fixture(scope="session")
def api_checkpoint(tmp_path_factory) -> str:
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("api") / "qwen3")


@pytest.fixture(scope="session")
def server(api_checkpoint):
    """Without warmup (--enforce-eager): its tests check what the API answers, and a
    program compiles when a request first needs it, not every bucket at start-up. The
    other servers (tool_server, test_startup.py's, ...) still warm up; warmup's programs
    are counted in tests/engine/test_warmup_budget.py."""
    srv = Server(api_checkpoint, "--enforce-eager")
    yield srv
    srv.stop()


# Prints the tools, every message's tool calls and tool-call ids: what the template got;
# chat_template_kwargs {"think": true} opens a think block, as Qwen3.5's template does.
TEMPLATE = (
    "{%- if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{%- for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}[call {{ c.function.name }} "
    "{{ c.function.arguments.city }}]{% endfor %}"
    "{%- if m.tool_call_id %}(id {{ m.tool_call_id }}){% endif %}</{{ m.role }}>{% endfor %}"
    "{%- if add_generation_prompt %}<assistant>{% if think %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="session")
def tool_server(api_checkpoint, tmp_path_factory):
    """A server started as vLLM users start one for agents, with TEMPLATE."""
    template = tmp_path_factory.mktemp("tmpl") / "chat.jinja"
    template.write_text(TEMPLATE)
    srv = Server(api_checkpoint, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                 "--reasoning-parser", "qwen3", "--chat-template", str(template),
                 "--max-model-len", "384")
    yield srv
    srv.stop()
