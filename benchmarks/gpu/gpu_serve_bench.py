"""The HTTP server under load, in one command: starts `jaxserve serve SERVER_ARGS`, waits
for GET /health 200, runs benchmarks/serving/serve.py against it (vLLM's `bench serve` metrics:
TTFT, TPOT, ITL, E2E, throughput), stops the server with SIGTERM.

    python -m benchmarks.gpu.gpu_serve_bench --server-args "llama-3.1-8b --load-format dummy" \\
        --num-prompts 128 --max-concurrency 64 --input-len 1024 --output-len 128 \\
        --output DIR/serve_8b.json [--server-log DIR/serve_8b.log]

The JSON (results_io.ProgressiveResults) gets the server's start-up (seconds to /health
200, its warmup line's counts) as soon as it is ready, then the load's metrics. A
SIGTERM to this process (a step's timeout) still stops the server: it must not keep
the device's memory from the next step.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.shared.results_io import ProgressiveResults
from benchmarks.serving.startup import _health, free_port, warmup_counts

_POLL_S = 0.2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--server-args", required=True, help="`jaxserve serve` arguments, one string")
    a("--num-prompts", type=int, default=128)
    a("--max-concurrency", type=int, default=64)
    a("--input-len", type=int, default=1024)
    a("--output-len", type=int, default=128)
    a("--ready-timeout", type=float, default=600, help="seconds the server may take to start")
    a("--output", required=True)
    a("--server-log", default=None, help="default: beside --output, .log")
    return p


def _stop_on_sigterm() -> None:
    """SIGTERM -> SystemExit, so the `finally` that stops the server runs."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def wait_ready(proc: subprocess.Popen, port: int, timeout: float, log_path: str) -> float:
    t0 = time.perf_counter()
    while True:
        if proc.poll() is not None:
            with open(log_path, encoding="utf-8", errors="replace") as f:
                raise RuntimeError(f"the server exited ({proc.returncode}):\n{f.read()[-3000:]}")
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"the server was not ready within {timeout:.0f} s")
        answer = _health(port)
        if answer is not None and answer[0] == 200:
            return time.perf_counter() - t0
        time.sleep(_POLL_S)


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    _stop_on_sigterm()
    log_path = args.server_log or os.path.splitext(args.output)[0] + ".log"
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve.console", "serve", *shlex.split(args.server_args),
           "--port", str(port)]
    out = ProgressiveResults(args.output, benchmark="gpu_serve_bench", argv=argv,
                             config={**vars(args), "server_command": shlex.join(cmd)})
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            ready = wait_ready(proc, port, args.ready_timeout, log_path)
            with open(log_path, encoding="utf-8", errors="replace") as f:
                out.save(server_ready_s=ready, warmup=warmup_counts(f.read()))
            from benchmarks.serving.serve import main as serve_main
            with tempfile.TemporaryDirectory() as tmp:
                report = os.path.join(tmp, "serve.json")
                serve_main(["--base-url", f"http://127.0.0.1:{port}", "--num-prompts",
                            str(args.num_prompts), "--max-concurrency",
                            str(args.max_concurrency), "--random-input-len",
                            str(args.input_len), "--random-output-len", str(args.output_len),
                            "--ignore-eos", "--result-json", report])
                with open(report, encoding="utf-8") as f:
                    run = json.load(f)["results"]["runs"][0]
            out.save(metrics=run["metrics"], seconds=time.perf_counter() - t0)
        finally:
            status = stop(proc)
    out.done(server_exit_status=status)
    return out.results


if __name__ == "__main__":
    main()
