"""Where an offline run's time goes: every engine step timed, grouped by batch rows.

    python -m benchmarks.step.step_times [--workload decode|prefill] [--num-prompts 64] \\
        [--mesh 1x2 --cpu-devices 2]

Runs throughput.py's jaxserve side (same model, workload and engine settings) and
times each step's host phases (schedule, input build, dispatch) and the wait for
the device (collect), then prints the medians and totals per group of steps:
decode steps by their number of rows, and the steps with more than 64 tokens
(prefill chunks) apart.
"""
from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time

import numpy as np

from benchmarks.shared.common import make_small_qwen3, workload
from benchmarks.shared.jaxserve_offline import generate, make_llm, split_cpu

# throughput.py's engine settings
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 64,
               "max_num_batched_tokens": 512}

ROW_GROUPS = ((1, 8), (9, 16), (17, 32), (33, 48), (49, 64))


def timed(times: list, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        times.append(time.perf_counter() - t0)
        return out
    return wrapper


def time_steps(llm) -> dict[str, list]:
    """Times every later step of llm's engine by phase (lists "schedule", "build",
    "dispatch", "collect", seconds) and records each step's "rows" and "tokens"."""
    core, runner = llm.engine, llm.engine.runner
    t: dict[str, list] = collections.defaultdict(list)
    core.scheduler.schedule = timed(t["schedule"], core.scheduler.schedule)
    runner.dispatch = timed(t["dispatch"], runner.dispatch)
    runner.collect = timed(t["collect"], runner.collect)
    build = runner.batch.build

    def build_and_count(rows):
        t["rows"].append(rows.num_reqs)
        t["tokens"].append(rows.num_tokens)
        return timed(t["build"], build)(rows)

    runner.batch.build = build_and_count
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(),
                                                         "jaxserve-bench-qwen3-small"))
    ap.add_argument("--mesh", default=None, help="the engine's DxM mesh, e.g. 1x2")
    ap.add_argument("--cpu-devices", type=int, default=None,
                    help="split the CPU into N XLA devices for --mesh")
    args = ap.parse_args()
    split_cpu(args.cpu_devices)
    mesh = {"mesh": args.mesh} if args.mesh else {}
    llm, _ = make_llm(make_small_qwen3(args.checkpoint), **ENGINE_ARGS, **mesh)
    t = time_steps(llm)
    items = workload(args.workload, args.num_prompts)
    compiles = llm.engine.num_compilations
    t0 = time.perf_counter()
    outputs = generate(llm, items, progress=False)
    seconds = time.perf_counter() - t0
    print(f"{args.workload}-heavy: {sum(map(len, outputs)) / seconds:.1f} output tok/s, "
          f"{seconds:.2f} s, {len(t['collect'])} steps, "
          f"{llm.engine.num_compilations - compiles} compilations")
    for phase in ("schedule", "build", "dispatch", "collect"):
        a = np.asarray(t[phase])
        print(f"  {phase:9s} median {np.median(a) * 1e3:6.2f} ms, total {a.sum():6.2f} s")
    rows, tokens = np.asarray(t["rows"]), np.asarray(t["tokens"])
    step = np.asarray(t["dispatch"]) + np.asarray(t["collect"])
    for lo, hi in ROW_GROUPS:
        m = (rows >= lo) & (rows <= hi) & (tokens <= 64)
        if m.any():
            print(f"  decode steps with {lo:2d}-{hi:2d} rows: {m.sum():4d} steps, median "
                  f"{np.median(step[m]) * 1e3:6.2f} ms, total {step[m].sum():6.2f} s")
    m = tokens > 64
    if m.any():
        print(f"  steps with > 64 tokens: {m.sum():4d} steps, total {step[m].sum():6.2f} s")


if __name__ == "__main__":
    main()
