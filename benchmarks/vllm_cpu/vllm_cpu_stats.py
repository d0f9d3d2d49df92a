"""The pure parts of `vllm_cpu.py`: how loaded the machine is, the A B A B order of the
runs, and the medians and tables of what they measured (tested without vLLM).

Load: a run's `other_cores` is the CPU other processes used while it ran, in cores
(results_io.other_load: the machine's busy time minus this process's and its waited
children's, over the wall time), so the servers and clients it started never count as
"others". Above `max_other_cores` a run is flagged `loaded`; before anything starts the
machine is watched for `window_s` and the benchmark refuses to start when it is busy.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.shared.results_io import BUSY_CORES, cpu_snapshot, markdown_table, other_load

SYSTEMS = ("jaxserve", "vllm")
ONLINE_METRICS = ("request_throughput", "output_throughput", "total_token_throughput",
                  "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                  "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
                  "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms")


def loadavg() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


@dataclass(frozen=True)
class Proc:
    command: str
    ppid: int
    cpu_s: float            # its own user + system time
    reaped_children_s: float   # of its children that ended and that it waited for


def process_cpu() -> dict[int, Proc]:
    """Every process /proc shows, by pid."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()   # from the state field on
        out[int(name)] = Proc(raw[raw.index("(") + 1:raw.rindex(")")], int(fields[1]),
                              (int(fields[11]) + int(fields[12])) / tick,
                              (int(fields[13]) + int(fields[14])) / tick)
    return out


def tree_cpu(procs: dict[int, Proc], root: int) -> float:
    """CPU seconds of `root` and every descendant alive, with their reaped children."""
    kids: dict[int, list[int]] = {}
    for pid, p in procs.items():
        kids.setdefault(p.ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            total += procs[pid].cpu_s + procs[pid].reaped_children_s
            todo += kids.get(pid, [])
    return total


@dataclass
class LoadWatch:
    """Started before a run, finished after its processes were waited for; a process
    of ours still running then (a server) is `live_root`: its tree is ours too."""
    max_other_cores: float = BUSY_CORES
    live_root: int | None = None

    def _live(self) -> float:
        return 0.0 if self.live_root is None else tree_cpu(process_cpu(), self.live_root)

    def __post_init__(self) -> None:
        self.live_start = self._live()
        self.start = cpu_snapshot()
        self.loadavg_start = loadavg()

    def finish(self) -> dict[str, Any]:
        end = cpu_snapshot()
        live = self._live() - self.live_start
        others = other_load(self.start, end)
        if others is not None and self.start is not None and end is not None:
            others = max(0.0, others - live / (end[2] - self.start[2]))
        return {"other_cores": None if others is None else round(others, 3),
                "loaded": others is not None and others > self.max_other_cores,
                "loadavg_start": self.loadavg_start, "loadavg_end": loadavg()}


def busiest(before: dict[int, Proc], after: dict[int, Proc], seconds: float,
            skip: Iterable[int] = (), top: int = 5) -> list[dict[str, Any]]:
    """The processes that used the most CPU between two process_cpu() snapshots."""
    skip = set(skip)
    used = [(after[p].cpu_s - before[p].cpu_s, p, after[p].command) for p in after
            if p in before and p not in skip]
    used.sort(reverse=True)
    return [{"pid": p, "command": c, "cores": round(u / seconds, 3)}
            for u, p, c in used[:top] if u > 0]


def quiet_check(window_s: float = 5.0, max_other_cores: float = BUSY_CORES) -> dict[str, Any]:
    """Watches the machine for `window_s` with nothing of ours running."""
    watch = LoadWatch(max_other_cores)
    before, t0 = process_cpu(), time.monotonic()
    time.sleep(window_s)
    after = process_cpu()
    res = watch.finish()
    res["busiest"] = busiest(before, after, time.monotonic() - t0, skip=[os.getpid()])
    res["window_s"] = window_s
    return res


def interleave(cases: Sequence[Any], repeats: int,
               systems: Sequence[str] = SYSTEMS) -> list[tuple[int, Any, str]]:
    """(repeat, case, system): for each case A B A B ..., so a slow spell of the machine
    falls on both systems rather than on one."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    return [(r, case, s) for case in cases for r in range(repeats) for s in systems]


def median_of(runs: Sequence[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def group(runs: Iterable[dict[str, Any]], keys: Sequence[str]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in runs:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def offline_summary(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, dtype): each system's median output tok/s over its runs, and
    jaxserve / vLLM (above 1: jaxserve is faster)."""
    rows = []
    for (model, dtype), case in group(runs, ("model", "dtype")).items():
        row: dict[str, Any] = {"model": model, "dtype": dtype}
        for system, rs in group(case, ("system",)).items():
            s = system[0]
            row[s] = {"output_tok_s": median_of(rs, "output_tok_s"),
                      "seconds": median_of(rs, "seconds"),
                      "startup_s": median_of(rs, "startup_s"), "runs": len(rs),
                      "loaded_runs": sum(bool(r.get("loaded")) for r in rs)}
        row["ratio"] = ratio(row.get("jaxserve", {}).get("output_tok_s"),
                             row.get("vllm", {}).get("output_tok_s"))
        rows.append(row)
    return rows


def online_summary(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, dtype, endpoint, concurrency): each system's median of every metric,
    and jaxserve / vLLM output throughput."""
    rows = []
    for key, case in group(runs, ("model", "dtype", "endpoint", "concurrency")).items():
        row: dict[str, Any] = dict(zip(("model", "dtype", "endpoint", "concurrency"), key))
        for system, rs in group(case, ("system",)).items():
            row[system[0]] = {**{m: median_of(rs, m) for m in ONLINE_METRICS},
                              "runs": len(rs),
                              "failed": sum(int(r.get("failed") or 0) for r in rs),
                              "loaded_runs": sum(bool(r.get("loaded")) for r in rs)}
        row["ratio"] = ratio(row.get("jaxserve", {}).get("output_throughput"),
                             row.get("vllm", {}).get("output_throughput"))
        rows.append(row)
    return rows


def offline_table(rows: Sequence[dict[str, Any]]) -> str:
    def side(r: dict, s: str, k: str) -> Any:
        return r.get(s, {}).get(k)
    return markdown_table(
        ["model", "dtype", "jaxserve out tok/s", "vLLM out tok/s", "jaxserve / vLLM",
         "greedy identical", "runs (loaded)"],
        [[r["model"], r["dtype"], side(r, "jaxserve", "output_tok_s"),
          side(r, "vllm", "output_tok_s"), r["ratio"], r.get("agreement_text"),
          f"{side(r, 'jaxserve', 'runs')}+{side(r, 'vllm', 'runs')} "
          f"({(side(r, 'jaxserve', 'loaded_runs') or 0) + (side(r, 'vllm', 'loaded_runs') or 0)})"]
         for r in rows])


def online_table(rows: Sequence[dict[str, Any]]) -> str:
    def pair(r: dict, k: str) -> str:
        a, b = r.get("jaxserve", {}).get(k), r.get("vllm", {}).get(k)
        f = (lambda x: "n/a" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.3g}")
        return f"{f(a)} / {f(b)}"
    return markdown_table(
        ["model", "dtype", "endpoint", "concurrency", "out tok/s (jaxserve / vLLM)",
         "jaxserve / vLLM", "median TTFT ms", "median TPOT ms", "median ITL ms",
         "failed", "loaded runs"],
        [[r["model"], r["dtype"], r["endpoint"], r["concurrency"], pair(r, "output_throughput"),
          r["ratio"], pair(r, "median_ttft_ms"), pair(r, "median_tpot_ms"),
          pair(r, "median_itl_ms"),
          sum(r.get(s, {}).get("failed", 0) for s in SYSTEMS),
          sum(r.get(s, {}).get("loaded_runs", 0) for s in SYSTEMS)] for r in rows])
