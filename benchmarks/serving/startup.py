"""Cold and warm start of `python -m jaxserve.api`: seconds until the port accepts
connections and until GET /health answers 200.

    python -m benchmarks.serving.startup --output-dir benchmarks/results [--server-args "..."]

Runs the server (the built-in tiny model unless --server-args names one) under a fresh
HOME, so its default compilation cache (~/.cache/jaxserve/xla) and default model start
empty: the cold start. Then runs it again under the same HOME: the warm start, whose
programs all come from the persistent compilation cache. Each start is stopped with
SIGTERM once ready. The programs compiled fresh / loaded from the cache are read from
the server's own warmup log line.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from benchmarks.shared.results_io import markdown_table, write_results

# The engine's summary (jaxserve.runner.warmup_report.WarmupSummary.describe).
_WARMUP = re.compile(r"warmup: (\d+) programs, (?:all (\d+) XLA compilations from the "
                     r"persistent compilation cache \(0 compiled\)|(\d+) XLA compilations "
                     r"compiled fresh, (\d+) from the persistent compilation cache)")
_POLL_S = 0.05


def warmup_counts(log: str) -> dict[str, int] | None:
    """{"programs", "fresh", "from_cache"} from a server log, or None if it has none."""
    m = _WARMUP.search(log)
    if m is None:
        return None
    programs, all_cached, fresh, cached = m.groups()
    if all_cached is not None:
        return {"programs": int(programs), "fresh": 0, "from_cache": int(all_cached)}
    return {"programs": int(programs), "fresh": int(fresh), "from_cache": int(cached)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> tuple[int, str] | None:
    """(status, body) of GET /health, or None when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return None


def _phase(body: str) -> str | None:
    m = re.search(r'"phase":\s*"([a-z_]+)"', body)
    return m.group(1) if m else None


def start_once(home: str, server_args: list[str], timeout: float, log_path: str
               ) -> dict[str, Any]:
    """One start: seconds to the open port and to /health 200, when each startup phase
    was first seen, and the warmup counts from the log."""
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAXSERVE_COMPILATION_CACHE", "JAXSERVE_CACHE")}
    env.update(HOME=home, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "jaxserve.api", "--port", str(port), *server_args]
    phases: dict[str, float] = {}
    port_open = ready = None
    with open(log_path, "w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while ready is None:
                elapsed = time.perf_counter() - t0
                if proc.poll() is not None or elapsed > timeout:
                    log.seek(0)
                    why = "exited" if proc.poll() is not None else "timed out"
                    raise RuntimeError(f"the server {why}:\n{log.read()[-4000:]}")
                answer = _health(port)
                if answer is not None:
                    if port_open is None:
                        port_open = elapsed
                    status, body = answer
                    if status == 200:
                        ready = time.perf_counter() - t0
                    elif (phase := _phase(body)) is not None:
                        phases.setdefault(phase, round(elapsed, 2))
                time.sleep(_POLL_S)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.seek(0)
        counts = warmup_counts(log.read())
    return {"port_open_s": round(port_open, 2), "ready_s": round(ready, 2),
            "phases_first_seen_s": phases, "warmup": counts, "exit_status": proc.returncode}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--server-args", default="",
                    help="extra flags for the server, one string (default: none, the "
                         "built-in tiny model with its defaults)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a start may take")
    ap.add_argument("--name", default="startup", help="name of the result files")
    args = ap.parse_args(argv)
    server_args = shlex.split(args.server_args)
    os.makedirs(args.output_dir, exist_ok=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="jaxserve-startup-home-") as home:
        for run in ("cold", "warm"):
            log = os.path.join(home, f"server-{run}.log")
            results[run] = start_once(home, server_args, args.timeout, log)
            print(f"{run}: port open {results[run]['port_open_s']} s, /health 200 "
                  f"{results[run]['ready_s']} s, warmup {results[run]['warmup']}", flush=True)
    rows = []
    for run, r in results.items():
        w = r["warmup"] or {}
        rows.append([run, r["port_open_s"], r["ready_s"], w.get("programs"), w.get("fresh"),
                     w.get("from_cache"), ", ".join(f"{p} {s} s" for p, s in
                                                    r["phases_first_seen_s"].items())])
    table = markdown_table(["start", "port open (s)", "/health 200 (s)", "programs",
                            "XLA compiled fresh", "from the persistent cache",
                            "phases first seen on /health"], rows)
    write_results(args.output_dir, args.name, benchmark="startup", argv=argv,
                  config={"server_args": server_args, "timeout_s": args.timeout,
                          "poll_s": _POLL_S, "home": "fresh temporary directory, "
                          "the same for both starts"},
                  results=results, table=table,
                  notes=["seconds from launching the process; the cold start also writes "
                         "the built-in model's files under the fresh HOME"])
    return results


if __name__ == "__main__":
    main()
