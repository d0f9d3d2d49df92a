"""Two processes on localhost under jax.distributed (CPU collectives: gloo), one
1x4 mesh over both (2 devices each): process 0 schedules, process 1 follows, and
the greedy tokens equal transformers' -- the same tokens one process gives
(test_mesh_parity.py)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from tests.sharding.test_mesh_parity import _prompts, _reference

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
MAX_TOKENS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_the_same_tokens(checkpoint, tmp_path):
    path = checkpoint("llama")
    prompts = _prompts()
    out = tmp_path / "tokens.json"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu",
           "JAXSERVE_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}",
           "JAXSERVE_NUM_PROCESSES": "2"}
    # Each process logs to a file: a pipe read only after the other process ends can fill
    # up and block its writer (jax's C++ runtime logs there too) until it misses heartbeats.
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, path, str(out), json.dumps(prompts), str(MAX_TOKENS)],
                env={**env, "JAXSERVE_PROCESS_ID": str(i)}, stdout=f, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    tails = "\n".join(f"--- process {i} ---\n{log.read_text()[-3000:]}"
                       for i, log in enumerate(logs))
    assert [p.returncode for p in procs] == [0, 0], tails
    got = json.loads(out.read_text())
    assert got["processes"] == 2 and got["devices"] == 4
    assert got["compilations_after_warmup"] == 0
    expected = [t[:MAX_TOKENS] for t in _reference(path, prompts)]
    assert got["tokens"] == expected
