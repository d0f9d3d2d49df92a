"""The decode step's HBM bytes on TPU, accounted op by op from the compiled programs,
beside the roofline bytes: `python -m jaxserve.plan ... --compile decode --json` for
each case, gathered into one table.

    python -m benchmarks.plan.step_bytes_tpu --output-dir benchmarks/results [--cases A,B]
    python -m benchmarks.plan.step_bytes_tpu --output-dir benchmarks/results --gather-only

Each case's JSON (the planner's own output) goes to <output-dir>/step_bytes_tpu/ as
soon as it is done (a flagship case compiles for minutes); step_bytes_tpu.json and .md
gather them. Every figure is libtpu's deviceless compile on this CPU host read by
jaxserve/planning/step_bytes.py, not a TPU measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from typing import Any

from benchmarks.shared.results_io import build_document, markdown_table, write_json

ROWS = "1,64,256"
GIB = 2**30
RATIO_LIMIT = 1.15   # above this, the step's excess is named in the notes (README)

# name: (the planner's flags: model, target, mesh, engine flags; decode rows)
CASES = {
    "llama-3.1-8b_v6e_1x1_64k": ("--model llama-3.1-8b --target tpu-v6e --mesh 1x1 "
                                 "--max-model-len 65536", ROWS),
    "qwen3.6-27b_v6e_1x8_8k_bf16": ("--model qwen3.6-27b --target tpu-v6e --mesh 1x8 "
                                    "--max-model-len 8192", ROWS),
    "qwen3.6-27b_v6e_1x8_8k_fp8": ("--model qwen3.6-27b --target tpu-v6e --mesh 1x8 "
                                   "--max-model-len 8192 --quantization fp8", ROWS),
    # bf16: 256 rows' sliding windows alone (26 GiB per chip) leave no room for the global
    # layers' pages, so at most 64 rows; an fp8 cache takes 256.
    "gemma-4-31b_v6e_1x8_8k_bf16_64seqs": ("--model gemma-4-31b --target tpu-v6e --mesh 1x8 "
                                           "--max-model-len 8192 --max-num-seqs 64", "1,64"),
    "gemma-4-31b_v6e_1x8_8k_fp8kv": ("--model gemma-4-31b --target tpu-v6e --mesh 1x8 "
                                     "--max-model-len 8192 --kv-cache-dtype fp8", ROWS),
}


def command(case: str) -> list[str]:
    flags, rows = CASES[case]
    return ["python", "-m", "jaxserve.plan", *shlex.split(flags), "--compile", "decode",
            "--decode-rows", rows, "--json"]


def run_case(case: str, path: str, timeout: float) -> None:
    """One case in its own process, stopped after `timeout` seconds: a case that fails or
    runs out of time is recorded as such (its `error`), and the next one runs."""
    t0 = time.perf_counter()
    try:
        run = subprocess.run([sys.executable, *command(case)[1:]], capture_output=True,
                             text=True, timeout=timeout)
        doc = json.loads(run.stdout) if run.returncode == 0 else {
            "error": f"exit status {run.returncode}: " + run.stderr.strip()[-2000:]}
    except subprocess.TimeoutExpired:
        doc = {"error": f"not done after {timeout:.0f} s (the case's time limit)"}
    doc["wall_seconds_here"] = time.perf_counter() - t0
    write_json(path, doc)


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f}"


def rows_of(case: str, doc: dict[str, Any]) -> tuple[list[list[Any]], list[list[Any]]]:
    steps, tops = [], []
    if doc.get("error"):
        return [[case, "", "", "error", doc["error"].splitlines()[0][:200], "", "", ""]], []
    for d in doc.get("decode", []):
        if d.get("error"):
            steps.append([case, d["rows"], d["context"], "error", d["error"], "", "", ""])
            continue
        roof = d["roofline"]
        steps.append([case, d["rows"], f"{d['context']:,}", _gib(d["step_bytes"]),
                      _gib(d["roofline_bytes"]),
                      f"**{d['ratio']:.2f}**" if d["ratio"] > RATIO_LIMIT else f"{d['ratio']:.2f}",
                      f"{_gib(roof['weight_bytes'])} / {_gib(roof['kv_read_bytes'])} / "
                      f"{_gib(roof['state_bytes'])}", _gib(d["compiler_bytes_accessed"])])
        for o in d["top_ops"][:6]:
            tops.append([case, d["rows"], f"{o['share']:.1%}", _gib(o["total"]), o["opcode"],
                         o["runs"], o["op_name"][-70:], o["how"]])
    return steps, tops


def markdown(docs: dict[str, dict[str, Any]]) -> str:
    steps, tops = [], []
    for case, doc in docs.items():
        s, t = rows_of(case, doc)
        steps += s
        tops += t
    return "\n\n".join([
        "Every figure: libtpu's deviceless compile on a CPU host, accounted by "
        "jaxserve/planning/step_bytes.py; not a TPU measurement. GiB per device.",
        "### Decode step bytes vs the roofline",
        markdown_table(["case", "rows", "context", "step bytes", "roofline bytes", "ratio",
                        "roofline: weights / KV read / state", "XLA cost analysis"], steps),
        "### The largest ops of each step (six at most; the JSON lists every op over 1 %)",
        markdown_table(["case", "rows", "share", "GiB", "op", "runs", "source", "how"], tops),
        "Commands: " + "; ".join(f"`{shlex.join(command(c))}`" for c in docs)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--gather-only", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds each case may take (its compiles)")
    args = ap.parse_args(argv)
    case_dir = os.path.join(args.output_dir, "step_bytes_tpu")
    os.makedirs(case_dir, exist_ok=True)
    wanted = [c for c in args.cases.split(",") if c]
    for case in wanted:
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}: expected one of {', '.join(CASES)}")
        if not args.gather_only:
            print(f"{case} ...", flush=True)
            run_case(case, os.path.join(case_dir, f"{case}.json"), args.timeout)
    docs = {}
    for case in CASES:
        path = os.path.join(case_dir, f"{case}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                docs[case] = json.load(f)
    write_json(os.path.join(args.output_dir, "step_bytes_tpu.json"),
               build_document(benchmark="step_bytes_tpu",
                              argv=sys.argv[1:] if argv is None else argv,
                              config={"cases": {c: shlex.join(command(c)) for c in CASES}},
                              results={"cases": docs}))
    table = markdown(docs)
    with open(os.path.join(args.output_dir, "step_bytes_tpu.md"), "w", encoding="utf-8") as f:
        f.write("# Decode step bytes on TPU\n\n" + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
