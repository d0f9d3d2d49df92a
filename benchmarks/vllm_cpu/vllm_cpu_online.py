"""Online side of `vllm_cpu.py`: a server (jaxserve or vLLM) started on a free local
port, driven by vLLM's own client (`vllm bench serve` from the vLLM venv) for each
endpoint and concurrency, then stopped.

Both servers get the same limits (max_model_len, max_num_seqs, max_num_batched_tokens),
dtype, served model name and checkpoint; the client sends the same seeded random
dataset (token ids drawn by vLLM's random dataset, decoded with the checkpoint's
word-level tokenizer, so every prompt re-encodes to exactly `input_len` tokens),
`ignore_eos`, temperature 0, all requests at once (`--request-rate inf`) behind
`--max-concurrency`. The server runs while the client measures, so a client run's load
check counts the server's whole process tree as ours (LoadWatch's `live_root`).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Sequence

from benchmarks.vllm_cpu.vllm_cpu_env import VllmVenv

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVED_NAME = "bench"
ENDPOINTS = {"completions": ("openai", "/v1/completions"),
             "chat": ("openai-chat", "/v1/chat/completions")}


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    seed: int = 0

    def flags(self) -> list[str]:
        return ["--max-model-len", str(self.max_model_len), "--max-num-seqs",
                str(self.max_num_seqs), "--max-num-batched-tokens",
                str(self.max_num_batched_tokens), "--seed", str(self.seed)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(system: str, model: str, dtype: str, port: int, limits: Limits,
                   venv: VllmVenv, jaxserve_flags: Sequence[str] = ()) -> list[str]:
    """jaxserve_flags: more of jaxserve's flags (an A/B of one, e.g. --async-scheduling)."""
    common = ["--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
              "--served-model-name", SERVED_NAME, *limits.flags()]
    if system == "jaxserve":
        return [sys.executable, "-m", "jaxserve.api", "--model", model, *common,
                "--disable-log-requests", *jaxserve_flags]
    return [venv.vllm, "serve", model, *common, "--disable-uvicorn-access-log"]


def jaxserve_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


@dataclass
class Server:
    system: str
    proc: subprocess.Popen
    base_url: str
    log_path: str
    startup_s: float = 0.0


def start_server(system: str, model: str, dtype: str, limits: Limits, venv: VllmVenv,
                 vllm_env: dict[str, str], log_path: str, timeout_s: float = 1200.0,
                 jaxserve_flags: Sequence[str] = ()) -> Server:
    """Starts the server and waits until GET /health answers 200."""
    port = free_port()
    cmd = server_command(system, model, dtype, port, limits, venv, jaxserve_flags)
    env = jaxserve_env() if system == "jaxserve" else vllm_env
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    server = Server(system, proc, f"http://127.0.0.1:{port}", log_path)
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{system} server exited with {proc.returncode} while starting; "
                               f"log {log_path}:\n{tail(log_path)}")
        try:
            with urllib.request.urlopen(server.base_url + "/health", timeout=5) as r:
                if r.status == 200:
                    server.startup_s = time.monotonic() - t0
                    return server
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    stop_server(server)
    raise RuntimeError(f"{system} server not ready after {timeout_s:.0f} s; log {log_path}")


def stop_server(server: Server) -> None:
    """SIGINT (both shut their engines down on it), then SIGTERM, then SIGKILL, to the
    server's whole process group; waits for it, so its CPU time is counted as ours."""
    for sig, wait_s in ((signal.SIGINT, 60), (signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        if server.proc.poll() is not None:
            break
        try:
            os.killpg(server.proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            server.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    server.proc.wait()


def client_command(venv: VllmVenv, server: Server, endpoint: str, concurrency: int,
                   num_prompts: int, input_len: int, output_len: int, tokenizer: str,
                   seed: int, result_dir: str, result_name: str) -> list[str]:
    backend, path = ENDPOINTS[endpoint]
    return [venv.vllm, "bench", "serve", "--backend", backend, "--endpoint", path,
            "--base-url", server.base_url, "--model", SERVED_NAME, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-range-ratio", "0",
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--num-warmups", "2",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--result-dir", result_dir,
            "--result-filename", result_name]


def run_client(cmd: list[str], env: dict[str, str], result_path: str, log_path: str,
               timeout_s: float = 3600.0) -> dict[str, Any]:
    """Runs `vllm bench serve`; returns its saved result JSON."""
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                              timeout=timeout_s, check=False)
    if done.returncode != 0 or not os.path.exists(result_path):
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}); log {log_path}:\n"
                           f"{tail(log_path)}")
    with open(result_path, encoding="utf-8") as f:
        return json.load(f)


def client_metrics(result: dict[str, Any], num_prompts: int) -> dict[str, Any]:
    """The figures kept from a `vllm bench serve` result (its per-request lists dropped)."""
    keep = ("duration", "completed", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "total_token_throughput")
    out = {k: result.get(k) for k in keep}
    out.update({k: v for k, v in result.items()
                if k.endswith("_ms") and isinstance(v, (int, float))})
    completed = result.get("completed")
    out["failed"] = (result["failed"] if isinstance(result.get("failed"), int) else
                     None if completed is None else num_prompts - int(completed))
    return out
