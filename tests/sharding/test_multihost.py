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
    procs = [subprocess.Popen([sys.executable, WORKER, path, str(out), json.dumps(prompts),
                               str(MAX_TOKENS)], env={**env, "JAXSERVE_PROCESS_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    got = json.loads(out.read_text())
    assert got["processes"] == 2 and got["devices"] == 4
    assert got["compilations_after_warmup"] == 0
    expected = [t[:MAX_TOKENS] for t in _reference(path, prompts)]
    assert got["tokens"] == expected
