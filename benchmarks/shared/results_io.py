"""The one results format of every benchmark: `<name>.json`, `<name>.md`, `<name>.png`
(the figure needs matplotlib, the `bench` extra; without it the other two are written).

JSON: {"benchmark", "command", "machine", "config", "results", "ratio", "agreement"}.
`ratio` (jaxserve / reference, higher is better for jaxserve) and `agreement` (greedy
outputs of the two systems) are null where a benchmark compares nothing.
"""
from __future__ import annotations

import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("jax", "jaxlib", "torch", "transformers")
BUSY_CORES = 0.2   # other processes' CPU use above which a run is flagged as disturbed


Snapshot = tuple[float, float, float]


def cpu_snapshot() -> Snapshot | None:
    """(busy CPU seconds of the whole machine, of this process and its children that
    ended, wall time), or None. A benchmark's own servers are children: not "others"."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")   # minus idle, iowait
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system, time.monotonic()


def other_load(start: Snapshot | None, end: Snapshot | None = None) -> float | None:
    """Cores' worth of CPU that other processes used from `start` to `end` (default now);
    0 = a quiet machine. On a shared machine that load slows a run several fold, torch's
    most."""
    end = end or cpu_snapshot()
    if start is None or end is None or end[2] - start[2] < 1.0:   # ticks are 10 ms
        return None
    others = ((end[0] - start[0]) - (end[1] - start[1])) / (end[2] - start[2])
    return min(max(0.0, others), float(os.cpu_count() or 1))


# Taken when this module is imported, first thing in every benchmark.
START_CPU = cpu_snapshot()
START_LOADAVG = os.getloadavg() if hasattr(os, "getloadavg") else None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    """Asks nvidia-smi (or an already imported torch): importing jax here would claim
    GPU memory before the reference runs."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10, check=False).stdout
            return out.strip().splitlines()[0] if out.strip() else None
        except (OSError, subprocess.SubprocessError):
            return None
    return None


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True,
                              timeout=10, check=False).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD") or None,
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def jax_device() -> dict[str, Any] | None:
    """The jax device, only if jax is already in use (never initialise it here)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    dev = jax.devices()[0]
    return {"platform": dev.platform, "device_kind": dev.device_kind,
            "count": jax.device_count()}


def machine_info() -> dict[str, Any]:
    torch = sys.modules.get("torch")
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "gpu": gpu_name(),
            "loadavg_start": START_LOADAVG, "other_processes_cores": other_load(START_CPU),
            "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "os": platform.platform(), "jax_device": jax_device(),
            "torch_device": ("cuda" if torch is not None and torch.cuda.is_available()
                             else "cpu"),
            "versions": versions(), "git": git_commit()}


def machine_line(m: dict[str, Any]) -> str:
    v, g = m["versions"], m["git"]
    dev = m["gpu"] or f"{m['cpu']} ({m['cpu_count']} cores)"
    commit = (g["commit"] or "?")[:10] + ("+dirty" if g["dirty"] else "")
    load = ""
    if m.get("other_processes_cores") is not None:
        load = f"; other processes used {m['other_processes_cores']:.2f} cores during the run"
    return (f"{dev}; jax {v['jax']}, torch {v['torch']}, transformers {v['transformers']}; "
            f"commit {commit}{load}")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        if x is None:
            return "n/a"
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"
        return str(x)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def clean(x: Any) -> Any:
    """Strict JSON: inf becomes "inf", nan becomes null, tuples become lists."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def module_of(benchmark: str) -> str:
    """The module that runs a benchmark: `benchmarks.<topic>.<name>` (the folders by
    topic), or `benchmarks.<name>` for a name no file has."""
    found = sorted(Path(REPO, "benchmarks").glob(f"*/{benchmark}.py"))
    return f"benchmarks.{found[0].parent.name}.{benchmark}" if found else f"benchmarks.{benchmark}"


def build_document(*, benchmark: str, argv: Sequence[str], config: dict[str, Any],
                   results: dict[str, Any], ratio: float | None = None,
                   agreement: dict[str, Any] | None = None,
                   notes: Sequence[str] = ()) -> dict[str, Any]:
    machine = machine_info()
    others = machine["other_processes_cores"]
    if others is not None and others > BUSY_CORES:
        notes = [*notes, (f"WARNING: other processes used {others:.2f} cores during this run; "
                          "its timings are not those of a quiet machine (torch suffers most)")]
    return {"benchmark": benchmark,
            "command": shlex.join(["python", "-m", module_of(benchmark), *argv]),
            "machine": machine, "config": config, "results": results, "ratio": ratio,
            "agreement": agreement, "notes": list(notes)}


def write_json(path: str, doc: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(clean(doc), f, indent=1, allow_nan=False)


PLOT_INSTALL = 'pip install -e ".[bench]"'   # the extra that brings matplotlib


def plot_library_missing(err: ImportError) -> bool:
    """True when `err` is matplotlib (or one of its modules) failing to import."""
    return (err.name or "").split(".")[0] == "matplotlib"


def try_plot(plot: Callable[[str], None], path: str) -> bool:
    """Draws `path`; without matplotlib, says so on stderr and returns False.

    A missing figure is not a failed benchmark: the measurement succeeded and its JSON
    and table are written before any plotting, so the run warns (naming the figure and
    the install command) and goes on to exit 0 — a script that checks the exit status
    still gets its numbers. Any other error, a bug in a plot, still raises."""
    try:
        plot(path)
    except ImportError as err:
        if not plot_library_missing(err):
            raise
        print(f"WARNING: plot {path} not drawn: matplotlib is not installed; "
              f"{PLOT_INSTALL} installs it (the results are written)",
              file=sys.stderr, flush=True)
        return False
    return True


def write_results(output_dir: str, name: str, *, benchmark: str, argv: Sequence[str],
                  config: dict[str, Any], results: dict[str, Any], table: str,
                  plot: Callable[[str], None] | None = None, ratio: float | None = None,
                  agreement: dict[str, Any] | None = None,
                  notes: Sequence[str] = ()) -> dict[str, str]:
    """Writes `<name>.json` and `<name>.md`, prints the table, then draws `<name>.png`
    (if `plot` and matplotlib are there); returns the paths of the files written."""
    os.makedirs(output_dir, exist_ok=True)
    doc = build_document(benchmark=benchmark, argv=argv, config=config, results=results,
                         ratio=ratio, agreement=agreement, notes=notes)
    paths = {ext: os.path.join(output_dir, f"{name}.{ext}") for ext in ("json", "md", "png")}
    md = [f"# {benchmark}: {name}", "", f"    {doc['command']}", "",
          f"Machine: {machine_line(doc['machine'])}", "", table, ""]
    md += [f"- {n}" for n in doc["notes"]] + ([""] if doc["notes"] else [])

    def write_md(lines: list[str]) -> None:
        with open(paths["md"], "w", encoding="utf-8") as f:
            f.write("\n".join(lines))

    # the measurement first: JSON and table are on disk whatever the plot does
    write_json(paths["json"], doc)
    write_md(md)
    print(table, flush=True)
    if os.path.exists(paths["png"]):   # an earlier run's figure: it would not match these
        os.remove(paths["png"])
    drawn = plot is not None and try_plot(plot, paths["png"])
    if drawn:
        write_md(md + [f"![{name}]({name}.png)", ""])
    elif plot is not None:   # asked for, but matplotlib is missing: the table says so
        write_md(md + [f"(figure {name}.png not drawn: matplotlib is not installed; "
                       f"`{PLOT_INSTALL}`)", ""])
    if not drawn:
        del paths["png"]
    print(f"wrote {', '.join(paths.values())}", flush=True)
    return paths


def new_figure(ncols: int, width: float = 5.0, height: float = 4.0):
    """A headless matplotlib figure with `ncols` side-by-side axes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return plt, fig, list(axes[0])


class ProgressiveResults:
    """One results document rewritten after every measurement (`save`), so a run stopped
    by its time limit still leaves what it had measured: a GPU session guards each step
    with a timeout, and a step's late figures must not take its early ones with it.
    `results["complete"]` turns true in the last save (`done`)."""

    def __init__(self, path: str, *, benchmark: str, argv: Sequence[str],
                 config: dict[str, Any]) -> None:
        self.path, self.benchmark, self.argv, self.config = path, benchmark, list(argv), config
        self.results: dict[str, Any] = {"complete": False}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def save(self, **results: Any) -> None:
        self.results.update(results)
        write_json(self.path, build_document(benchmark=self.benchmark, argv=self.argv,
                                             config=self.config, results=self.results))

    def done(self, **results: Any) -> None:
        self.save(**results, complete=True)
