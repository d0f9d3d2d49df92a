"""The engine's programs compiled for TPUs on this CPU host: memory and cost estimates.

    python -m benchmarks.plan.plan_tpu --output-dir benchmarks/results [--cases NAME,...]

For each case (model, mesh, TPU target, max_model_len) the engine is built as `LLM`
would build it for that chip, with abstract weights (jaxserve/plan_compile.py), and
libtpu's deviceless XLA:TPU + Mosaic compilers compile the forward step at token
buckets 16, 64, 256 and the largest, and the costliest sampler variant. Reported:
per-device memory from the compiler next to the planner's (`python -m jaxserve.plan`),
compile seconds per program, and the compiler's cost estimate of the decode step
(cost_analysis: optimal_seconds, bytes accessed) at 1, 64 and 256 rows against the HBM
roofline. Every figure is a compiler estimate on a CPU host, not a TPU measurement.

Each case is written to <output-dir>/plan_tpu/<case>.json as soon as it is done (a
flagship case takes many minutes), then plan_tpu.json and plan_tpu.md gather them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.shared.results_io import build_document, markdown_table, write_json

LABEL = "compiler estimate on a CPU host, not a TPU measurement"
DECODE_ROWS = (1, 64, 256)
GIB = 2**30


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    mesh: str
    target: str
    max_model_len: int | None     # None: the model's default
    hbm_utilization: float = 0.9


CASES = (
    Case("qwen3.6-27b_v6e_1x8_8k", "qwen3.6-27b", "1x8", "tpu-v6e", 8192),
    Case("qwen3.6-27b_v5e_1x8_8k", "qwen3.6-27b", "1x8", "tpu-v5e", 8192),
    Case("qwen3.6-27b_v6e_1x8_default", "qwen3.6-27b", "1x8", "tpu-v6e", None),
    Case("qwen3-8b_v6e_1x1_default", "qwen3-8b", "1x1", "tpu-v6e", None),
    Case("llama-3.1-8b_v6e_1x1_default", "llama-3.1-8b", "1x1", "tpu-v6e", None),
    # 131,072 tokens of KV (16 GiB) do not fit beside 15 GiB of weights on one v6e chip:
    # the engine refuses the default; this is the longest power of two that fits.
    Case("llama-3.1-8b_v6e_1x1_64k", "llama-3.1-8b", "1x1", "tpu-v6e", 65536),
)


def selection(programs: list) -> list:
    """The forward at the decode buckets of DECODE_ROWS and the largest, and the
    default selection's sampler."""
    from jaxserve.planning.plan_compile import default_selection
    from jaxserve.runner.buckets import pick_bucket
    from jaxserve.runner.programs import FORWARD

    forwards = [p for p in programs if p.kind == FORWARD]
    widest = max(p.pages for p in forwards)
    buckets = sorted({p.tokens for p in forwards})
    want = {pick_bucket(tuple(buckets), r) for r in DECODE_ROWS} | {buckets[-1]}
    picked = [p for p in forwards if p.pages == widest and p.tokens in want]
    return picked + [p for p in default_selection(programs) if p.kind != FORWARD]


def run_case(case: Case) -> dict[str, Any]:
    from jaxserve.checkpoints.model_names import load_model_config
    from jaxserve.planning.plan import make_plan
    from jaxserve.planning.plan_compile import compile_plan
    from jaxserve.runner.buckets import pick_bucket
    from sharding.tpu_targets import tpu_target

    target = tpu_target(case.target)
    kw = {"max_model_len": case.max_model_len} if case.max_model_len else {}
    start = time.perf_counter()
    report = compile_plan(case.model, target=case.target, mesh=case.mesh,
                          select=selection,
                          hbm_utilization=case.hbm_utilization,
                          progress=lambda r: print(f"  {case.name}: {r.name} "
                                                   f"{r.tokens or r.rows} compiled={r.compiled} "
                                                   f"{r.compile_seconds:.0f} s", flush=True),
                          **kw)
    m = int(case.mesh.split("x")[1])
    plan = make_plan(load_model_config(case.model), model=case.model, mesh=f"1x{m}",
                     max_model_len=case.max_model_len, hbm_bytes=target.usable_hbm_bytes,
                     hbm_utilization=case.hbm_utilization)
    bw = target.hbm_gbps * 1e9
    decode = []
    forwards = {p.tokens: p for p in report.programs if p.name == "forward"}
    buckets = tuple(sorted(forwards))
    for rows in DECODE_ROWS:
        p = forwards.get(pick_bucket(buckets, rows)) if buckets else None
        # Rows hold what the cache can: max_model_len each, or an equal share of it.
        context = min(plan.max_model_len, plan.kv_tokens // rows) if plan.kv_tokens else 0
        kv = rows * context * plan.kv_bytes_per_token_per_device
        state = 2 * rows * plan.state_bytes_per_seq_per_device   # read and written back
        decode.append({
            "rows": rows, "token_bucket": p.tokens if p else None, "context": context,
            "compiled": bool(p and p.compiled),
            "compiler_optimal_seconds": p.optimal_seconds if p else None,
            "compiler_bytes_accessed": p.bytes_accessed if p else None,
            "compiler_flops": p.flops if p else None,
            "roofline_weights_seconds": plan.weight_bytes_per_device / bw,
            "roofline_seconds": (plan.weight_bytes_per_device + kv + state) / bw,
            "roofline_bytes": plan.weight_bytes_per_device + kv + state})
    return {"case": case.name, "model": case.model, "mesh": case.mesh, "target": case.target,
            "hbm_gbps": target.hbm_gbps, "wall_seconds": time.perf_counter() - start,
            "report": report.to_json(), "decode": decode, "label": LABEL}


def _gib(n: float | None) -> str | None:
    return None if n is None else f"{n / GIB:.2f}"


def markdown(results: list[dict[str, Any]]) -> str:
    mem_rows, prog_rows, dec_rows = [], [], []
    for r in results:
        rep = r["report"]
        ok = [p for p in rep["programs"] if p["compiled"]]
        arg = max((p["argument_bytes"] for p in ok if p["name"] == "forward"), default=None)
        planner = rep["planner_bytes_per_device"]
        mem_rows.append([
            r["case"], rep["max_model_len"], _gib(rep["hbm_bytes"]),
            rep["num_pages"], _gib(planner), _gib(arg),
            None if arg is None or planner is None else f"{(planner - arg) / 2**20:.0f} MiB",
            _gib(max((p["device_peak_bytes"] for p in ok), default=None)),
            "yes" if rep["fits"] else "no", rep["warmup_programs"] or None,
            (rep["error"] or "")[:160] or None])
        for p in rep["programs"]:
            prog_rows.append([r["case"], p["name"], p["tokens"] or p["rows"],
                              "yes" if p["compiled"] else "no", round(p["compile_seconds"], 1),
                              _gib(p["argument_bytes"]), _gib(p["temp_bytes"]),
                              _gib(p["peak_bytes"]), _gib(p["device_peak_bytes"]),
                              (p["error"] or "").splitlines()[0][:150] if p["error"] else None])
        for d in r["decode"]:
            acc = d["compiler_bytes_accessed"]
            dec_rows.append([r["case"], d["rows"], d["token_bucket"], d["context"], _gib(acc),
                             None if acc is None else round(acc / r["hbm_gbps"] / 1e6, 1),
                             _gib(d["roofline_bytes"]),
                             round(d["roofline_weights_seconds"] * 1e3, 2),
                             round(d["roofline_seconds"] * 1e3, 2)])
    return "\n\n".join([
        f"Every figure: {LABEL}. Bytes in GiB per device unless marked.",
        "### Memory: the compiler vs the planner",
        "planner: `python -m jaxserve.plan`'s weights + KV + state per device; compiler "
        "forward argument: what XLA:TPU says the forward step takes (it drops the unused "
        "lm_head, and pads small arrays); device peak: the largest, over the compiled "
        "programs, of a program's own peak plus what stays resident beside it.",
        markdown_table(["case", "max_model_len", "HBM", "pages", "planner weights+KV+state",
                        "compiler forward argument", "planner - compiler",
                        "largest device peak", "fits", "warmup programs", "error"], mem_rows),
        "### Compile seconds per program",
        markdown_table(["case", "program", "bucket", "compiled", "seconds", "argument", "temp",
                        "peak", "device peak", "error"], prog_rows),
        "### Decode step: the compiler's cost estimate vs the HBM roofline",
        "Roofline: (weights + rows x context x KV bytes per token (+ a hybrid's state, read "
        "and written) per device) / the chip's published HBM bandwidth; context = "
        "max_model_len or the rows' equal share of the KV cache. Compiler: `bytes accessed` "
        "of the forward program's cost_analysis at the rows' token bucket, an upper bound, "
        "not a prediction of the step's time: XLA's cost model charges the in-place "
        "write_kv scatters for the caches they write into, and the attention kernel's "
        "pl.CostEstimate counts min(rows, tokens) rows x the page table's full width. Its "
        "optimal_seconds is in the JSON but meaningless: XLA:TPU gives scatters negative time.",
        markdown_table(["case", "rows", "token bucket", "context", "compiler bytes accessed",
                        "compiler bytes / bandwidth ms", "roofline bytes",
                        "roofline ms (weights only)", "roofline ms (weights + KV)"], dec_rows)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--cases", default=",".join(c.name for c in CASES))
    ap.add_argument("--gather-only", action="store_true",
                    help="only gather the per-case files into plan_tpu.json / .md")
    args = ap.parse_args(argv)
    case_dir = os.path.join(args.output_dir, "plan_tpu")
    os.makedirs(case_dir, exist_ok=True)
    wanted = args.cases.split(",")
    for case in CASES:
        if case.name not in wanted or args.gather_only:
            continue
        print(f"{case.name} ...", flush=True)
        result = run_case(case)
        write_json(os.path.join(case_dir, f"{case.name}.json"), result)
    results = []
    for case in CASES:
        path = os.path.join(case_dir, f"{case.name}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                results.append(json.load(f))
    doc = build_document(benchmark="plan_tpu", argv=sys.argv[1:] if argv is None else argv,
                         config={"cases": [c.__dict__ for c in CASES], "label": LABEL},
                         results={"cases": results})
    write_json(os.path.join(args.output_dir, "plan_tpu.json"), doc)
    with open(os.path.join(args.output_dir, "plan_tpu.md"), "w", encoding="utf-8") as f:
        f.write("# TPU compile plan\n\n" + markdown(results) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
