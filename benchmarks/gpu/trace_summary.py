"""Where a step's time goes, from a `jax.profiler.trace` folder: the Chrome-trace JSON jax
writes beside its xplane (`*.trace.json.gz`), read with the standard library alone so the
summary is made on the device machine and again here from the carried-back file.

    python -m benchmarks.gpu.trace_summary TRACE_DIR [--steps N] [--top 25]

Only the last --steps periods between launches of the step's jitted function
(`--step-fn`, a substring of its name: the engine's `_forward_fn`) are read: a trace of a
whole generate() keeps its last decode steps and drops the prefill and the trace's end.
Per window: the wall span of the host's python thread; the host's time inside jitted calls
(`PjitFunction(name)`: argument handling and launch, per function) and waiting on results
(`Await`); on each device (a process named `/device:...`), the busy time (the union of its
kernels' intervals, over all streams), the number of kernels and the top kernels by total
time. Divided by --steps (the decode steps traced), these give a step's split: device
busy, host launch, and the rest (gaps the device sat idle).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
from typing import Any

_PJIT = re.compile(r"^PjitFunction\((.*)\)$")


def trace_file(folder: str) -> str | None:
    """The newest `*.trace.json.gz` under a jax.profiler.trace folder."""
    files = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
    return max(files, key=os.path.getmtime) if files else None


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _outermost_calls(spans: list[dict], on_python) -> list[dict]:
    """The spans less each jitted call's nested copy: jax records a call twice (the
    Python wrapper's span and the C++ one inside it, same name)."""
    keep, open_until = [], {}
    for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        if on_python(e) and _PJIT.match(e["name"]):
            if e["ts"] < open_until.get(e["name"], float("-inf")):
                continue
            open_until[e["name"]] = e["ts"] + e["dur"]
        keep.append(e)
    return keep


def summarise(path: str, steps: int = 1, top: int = 25,
              step_fn: str = "forward") -> dict[str, Any]:
    """The module doc's figures, in milliseconds (per step where named so)."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    ms = 1e-3   # trace times are microseconds

    def on_python(e: dict) -> bool:
        # ("python" in jax 0.10's traces, "python3" in the GPU image's jax 0.11)
        return threads.get((e["pid"], e.get("tid")), "").startswith("python") and \
            procs.get(e["pid"], "").startswith("/host")

    spans = _outermost_calls(spans, on_python)
    launches = sorted(e["ts"] for e in spans if on_python(e) and step_fn in
                      (_PJIT.match(e["name"]) or [None, ""])[1])
    if len(launches) >= 2:   # the window: from the last `steps` + 1 launches, whole periods
        steps = min(max(1, steps), len(launches) - 1)
        start, end = launches[-steps - 1], launches[-1]
        spans = [e for e in spans if start <= e["ts"] < end]
    steps = max(1, steps)
    python = [e for e in spans if on_python(e)]
    wall = (end - start) if len(launches) >= 2 else \
        (max(e["ts"] + e["dur"] for e in python) - min(e["ts"] for e in python)) if python \
        else 0.0
    launch: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.Counter()
    for e in python:
        m = _PJIT.match(e["name"])
        if m:
            launch[m.group(1)] += e["dur"]
            calls[m.group(1)] += 1
    await_us = sum(e["dur"] for e in python if e["name"].endswith("Await"))

    devices = []
    for pid, name in sorted(procs.items()):
        if not name.startswith("/device:"):
            continue
        kernels = [e for e in spans if e["pid"] == pid]
        if not kernels:
            continue
        by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        for e in kernels:
            by_name[e["name"]][0] += e["dur"]
            by_name[e["name"]][1] += 1
        busy = _busy([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        devices.append({
            "device": name, "kernels_per_step": len(kernels) / steps,
            "busy_ms_per_step": busy * ms / steps,
            "top": [{"name": k[:160], "ms_per_step": v[0] * ms / steps,
                     "calls_per_step": v[1] / steps, "share_of_busy": v[0] / busy}
                    for k, v in ranked]})
    return {"file": os.path.basename(path), "steps": steps, "step_launches": len(launches),
            "wall_ms_per_step": wall * ms / steps,
            "host_launch_ms_per_step": {k: v * ms / steps for k, v in
                                        sorted(launch.items(), key=lambda kv: -kv[1])},
            "host_calls_per_step": {k: v / steps for k, v in calls.items()},
            "host_await_ms_per_step": await_us * ms / steps,
            "devices": devices}


def markdown(s: dict[str, Any], title: str = "") -> str:
    """A short Markdown report of `summarise`'s figures."""
    lines = [f"#### {title or s['file']}: {s['steps']} steps traced", "",
             f"- wall {s['wall_ms_per_step']:.2f} ms a step; host awaiting results "
             f"{s['host_await_ms_per_step']:.2f} ms"]
    launch = ", ".join(f"{k} {v:.2f}" for k, v in list(s["host_launch_ms_per_step"].items())[:6])
    lines.append(f"- host inside jitted calls (ms a step): {launch or 'none traced'}")
    for d in s["devices"]:
        lines += [f"- {d['device']}: busy {d['busy_ms_per_step']:.2f} ms a step, "
                  f"{d['kernels_per_step']:.0f} kernels a step", "",
                  "| kernel | ms a step | calls a step | share of busy |", "|---|---|---|---|"]
        lines += [f"| `{k['name'][:90]}` | {k['ms_per_step']:.3f} | {k['calls_per_step']:.1f} | "
                  f"{k['share_of_busy']:.1%} |" for k in d["top"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--step-fn", default="forward")
    args = ap.parse_args(argv)
    path = trace_file(args.folder)
    if path is None:
        raise SystemExit(f"no *.trace.json.gz under {args.folder}")
    print(markdown(summarise(path, args.steps, args.top, args.step_fn)))


if __name__ == "__main__":
    main()
