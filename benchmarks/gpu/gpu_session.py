"""The GPU session's summary: every step's figures, with device, jax version, commit
and command, in one JSON and one Markdown file, plus the steps' files in one archive.

    python -m benchmarks.gpu.gpu_session summary --work DIR --out DIR [--mode full|tiny]
    python -m benchmarks.gpu.gpu_session tiny-models --dir DIR   # tiny mode's checkpoints

benchmarks/gpu_session.sh runs the steps (each under its own time limit) and calls the
summary after each, so a session stopped at any point leaves a summary of what ran.
The device tool brings back at most 8 files from $OUT: the summary writes three
(summary.json, summary.md, details.tar.gz with every step's JSON and log).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import tarfile
from typing import Any

from benchmarks.shared.results_io import git_commit, markdown_table, write_json

KERNEL_LOG = ("attention:", "linear attention:", "matmul:", "XLA:GPU flags:",
              "JAX started before the engine")   # the engine's kernel choices and flags
TOP_KERNELS = 8            # a profile's kernels in the summary (all 25 in details.tar.gz)
TRACE_MAX_BYTES = 16 << 20  # traces carried back in details.tar.gz up to this size


def step_status(work: str) -> list[dict[str, Any]]:
    """status/NAME: "rc seconds limit" written by gpu_session.sh; status/NAME.cmd: the
    command. In the order the steps ran."""
    out = []
    for path in sorted(glob.glob(os.path.join(work, "status", "*")), key=os.path.getmtime):
        if path.endswith(".cmd"):
            continue
        name = os.path.basename(path)
        fields = open(path, encoding="utf-8").read().split()
        rc, seconds, limit = (int(x) for x in (fields + ["-1"] * 3)[:3])
        cmd_path = path + ".cmd"
        command = open(cmd_path, encoding="utf-8").read().strip() \
            if os.path.exists(cmd_path) else None
        status = {0: "ok", 124: "timed out", 137: "timed out (killed)", -2: "skipped"}.get(
            rc, f"failed (exit {rc})")
        out.append({"name": name, "status": status, "rc": rc, "seconds": seconds,
                    "limit_s": limit, "command": command})
    return out


def load(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def engine_figures(doc: dict[str, Any]) -> dict[str, Any]:
    r = doc["results"]
    start = r.get("startup") or {}
    lat = r.get("latency") or {}
    return {
        "device": r.get("device"), "complete": r.get("complete"),
        "startup_s": start.get("seconds"), "warmup_s": start.get("warmup_seconds"),
        "warmup_programs": start.get("warmup_programs"),
        "weight_bytes_per_device": start.get("weight_bytes_per_device"),
        "throughput": [{k: t[k] for k in ("rows", "requests_per_second", "tokens_per_second",
                                          "output_tokens_per_second", "compilations_during_run")}
                       for t in r.get("throughput", [])],
        "ttft_ms": lat.get("ttft_ms"), "tpot_ms": lat.get("tpot_ms"),
        "compilations_after_warmup": r.get("compilations_after_warmup"),
        "kernels": [ln for ln in r.get("log", []) if ln.startswith(KERNEL_LOG)],
        "profile": [profile_figures(p) for p in r.get("profile", [])]}


def profile_figures(p: dict[str, Any]) -> dict[str, Any]:
    """A traced run's split of a decode step (benchmarks/gpu/trace_summary.py)."""
    if "error" in p:
        return {"rows": p.get("rows"), "error": p["error"]}
    dev = (p.get("devices") or [{}])[0]
    return {"rows": p["rows"], "rows_decoding": p.get("rows_at_trace_start"),
            "steps": p["steps"], "wall_ms": p["wall_ms_per_step"],
            "host_launch_ms": p["host_launch_ms_per_step"],
            "host_await_ms": p["host_await_ms_per_step"],
            "device_busy_ms": dev.get("busy_ms_per_step"),
            "kernels": dev.get("kernels_per_step"), "top": (dev.get("top") or [])[:TOP_KERNELS]}


def figures(name: str, work: str) -> tuple[dict[str, Any] | None, str | None]:
    """(figures, the JSON file they came from) of one step, or (None, None)."""
    if name.startswith("check_"):
        path = os.path.join(work, f"engine_{name}.json")
        doc = load(path)
        if doc is None:
            return None, None
        return {"rows": [{k: row.get(k) for k in ("case", "passed", "floors", "pallas", "xla",
                                                  "error", "wall_s")}
                         for row in doc["rows"]],
                "device": doc.get("device"), "jax": doc.get("jax")}, path
    path = os.path.join(work, f"{name}.json")
    doc = load(path)
    if doc is None:
        return None, None
    if "restore_share_of_link" in doc:   # benchmarks/cache/host_tier_copies.py
        return {k: doc[k] for k in ("device", "memory_kind", "copied_bytes", "gb_per_s",
                                    "restore_share_of_link")}, path
    kind, r = doc.get("benchmark"), doc.get("results", {})
    if kind == "roofline":
        return {"copy_gb_per_s": r["best"]["copy_gb_per_s"],
                "matmul_tflops_by_dtype": r["best"].get("matmul_tflops_by_dtype"),
                "device": r["best"]["device"]}, path
    if kind == "scan_weights_probe":
        return {"probe": r["variants"]}, path
    if kind == "gpu_engine_bench":
        return engine_figures(doc), path
    if kind == "gpu_torch_bench":
        return {"device": r.get("device"), "load_s": r.get("load_seconds"),
                "batches": r.get("batches", [])}, path
    if kind == "gpu_serve_bench":
        m = r.get("metrics") or {}
        keep = ("completed", "failed", "duration_s", "request_throughput", "output_throughput",
                "total_token_throughput")
        return {"server_ready_s": r.get("server_ready_s"), "warmup": r.get("warmup"),
                **{k: m.get(k) for k in keep},
                **{k: {s: (m.get(k) or {}).get(s) for s in ("mean_ms", "p99_ms")}
                   for k in ("ttft", "tpot", "itl", "e2el")}}, path
    return {"results": r}, path


def provenance(work: str, steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Device, jax version and commit: from the first step file that has them."""
    for s in steps:
        _, path = figures(s["name"], work)
        doc = load(path) if path else None
        if doc and "machine" in doc:
            m = doc["machine"]
            dev = (m.get("jax_device") or {}).get("device_kind") or m.get("gpu") or m.get("cpu")
            return {"device": dev, "gpu": m.get("gpu"), "jax": m["versions"].get("jax"),
                    "torch": m["versions"].get("torch"),
                    "transformers": m["versions"].get("transformers"), "git": m.get("git")}
    return {"device": None, "jax": None, "git": git_commit()}


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def step_markdown(step: dict[str, Any]) -> list[str]:
    f = step.get("figures")
    lines = [f"### {step['name']}: {step['status']} ({step['seconds']} s of {step['limit_s']})",
             "", f"    {step['command']}", ""]
    if not f:
        return lines + ["no figures (see its log in details.tar.gz)", ""]
    name = step["name"]
    if "copy_gb_per_s" in f:
        rows = [["copy (read + write, donated, best)", f"{f['copy_gb_per_s']:.0f} GB/s"]]
        rows += [[f"matmul {d} (best)", "n/a" if t is None else f"{t:.1f} TFLOP/s"]
                 for d, t in (f["matmul_tflops_by_dtype"] or {}).items()]
        lines.append(markdown_table(["roofline", "figure"], rows))
    elif "restore_share_of_link" in f:
        lines.append(f"{f['copied_bytes'] / 2**20:.0f} MiB each way, host memory kind "
                     f"{f['memory_kind'] or '(default)'}")
        lines += [""] + [markdown_table(["copy", "GB/s"], [
            [k, f"{v:.2f}"] for k, v in f["gb_per_s"].items()] + [
            ["restore / link to device", f"{f['restore_share_of_link']:.0%}"]])]
    elif "throughput" in f:
        lines.append(f"start-up {f['startup_s'] and round(f['startup_s'], 1)} s (warmup "
                     f"{f['warmup_s'] and round(f['warmup_s'], 1)} s, {f['warmup_programs']} "
                     f"programs); batch 1: TTFT {_ms(f['ttft_ms'])} ms, TPOT "
                     f"{_ms(f['tpot_ms'])} ms; compilations after warmup: "
                     f"{f['compilations_after_warmup']}")
        lines += [""] + [f"- {k}" for k in f["kernels"]] + [""]
        lines.append(markdown_table(
            ["rows", "req/s", "total tok/s", "output tok/s", "compiles in run"],
            [[t["rows"], t["requests_per_second"], t["tokens_per_second"],
              t["output_tokens_per_second"], t["compilations_during_run"]]
             for t in f["throughput"]]))
        for p in f.get("profile") or []:
            lines += [""] + profile_markdown(p)
    elif "batches" in f:
        lines.append(markdown_table(
            ["batch", "TTFT ms", "TPOT ms", "output tok/s", "torch.compile"],
            [[b["batch"], b["ttft_ms"], b["tpot_ms"], b["output_tokens_per_s"],
              b["torch_compile"]] for b in f["batches"]]))
    elif "server_ready_s" in f:
        lines.append(markdown_table(
            ["ready s", "ok / failed", "req/s", "output tok/s", "TTFT mean / p99 ms",
             "TPOT mean / p99 ms", "ITL mean / p99 ms"],
            [[f["server_ready_s"], f"{f['completed']} / {f['failed']}",
              f["request_throughput"], f["output_throughput"],
              *(f"{_ms(f[k]['mean_ms'])} / {_ms(f[k]['p99_ms'])}"
                for k in ("ttft", "tpot", "itl"))]]))
    elif "probe" in f:
        lines.append(markdown_table(
            ["variant", "XLA flags", "rows", "ms a step", "weights GB/s", "HLO copies",
             "compile s"],
            [[v["variant"], v["xla_flags"] or "(none)", *(
                (r["rows"], r["ms_per_step"], r["weight_GBps"], r["hlo_copies"],
                 r["compile_s"]) if "runs" in v else ("error", v["error"][-120:], "", "", ""))]
             for v in f["probe"] for r in (v.get("runs") or [{}])]))
    elif "rows" in f:
        table = []
        for r in f["rows"]:
            if r.get("error"):
                table.append([r["case"], "error", r["error"][:100], "", ""])
                continue
            table.append([r["case"], "passed" if r["passed"] else "BELOW FLOOR",
                          *(f"{r[b]['identical_requests']} identical, mean "
                            f"{r[b]['prompt_logprob_mean_abs_diff']:.4f}"
                            for b in ("pallas", "xla")), r["wall_s"]])
        lines.append(markdown_table(["case", "floors", "pallas vs f32 reference",
                                     "xla vs f32 reference", "s"], table))
    else:
        lines.append(f"```\n{json.dumps(f)[:2000]}\n```")
    del name
    return lines + [""]


def profile_markdown(p: dict[str, Any]) -> list[str]:
    if "error" in p:
        return [f"profile, {p['rows']} rows: {p['error']}"]
    launch = ", ".join(f"{k} {v:.2f}" for k, v in p["host_launch_ms"].items())
    busy = "n/a" if p["device_busy_ms"] is None else f"{p['device_busy_ms']:.2f}"
    lines = [f"profile, {p['rows']} rows ({p['steps']} decode steps traced): a step "
             f"{p['wall_ms']:.2f} ms, device busy {busy} ms ({p['kernels'] or 0:.0f} kernels); "
             f"host inside jitted calls (ms): {launch or 'none'}; awaiting results "
             f"{p['host_await_ms']:.2f} ms", ""]
    if p["top"]:
        lines.append(markdown_table(
            ["kernel", "ms a step", "calls a step", "share of busy"],
            [[f"`{k['name'][:80]}`", f"{k['ms_per_step']:.3f}", f"{k['calls_per_step']:.1f}",
              f"{k['share_of_busy']:.1%}"] for k in p["top"]]))
    return lines


def summary(work: str, out: str, mode: str) -> dict[str, Any]:
    steps = step_status(work)
    for s in steps:
        s["figures"], path = figures(s["name"], work)
        s["file"] = os.path.basename(path) if path else None
    prov = provenance(work, steps)
    doc = {"session": {"mode": mode, **prov,
                       "total_seconds": sum(max(0, s["seconds"]) for s in steps),
                       "command": "bash benchmarks/gpu_session.sh"
                       + (" --tiny" if mode == "tiny" else "")},
           "steps": steps}
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "summary.json"), doc)
    git = prov.get("git") or {}
    head = [f"# GPU session ({mode})", "",
            f"Device {prov.get('device')}, jax {prov.get('jax')}, torch {prov.get('torch')}, "
            f"commit {(git.get('commit') or '?')[:10]}{'+dirty' if git.get('dirty') else ''}; "
            f"{doc['session']['total_seconds']} s of steps. Each step's JSON (in "
            "details.tar.gz) repeats device, versions, commit and its command.", ""]
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(head + [ln for s in steps for ln in step_markdown(s)]))
    with tarfile.open(os.path.join(out, "details.tar.gz"), "w:gz") as tar:
        for path in sorted(glob.glob(os.path.join(work, "*.json"))
                           + glob.glob(os.path.join(work, "*.log"))
                           + glob.glob(os.path.join(work, "*.md"))):
            tar.add(path, arcname=os.path.basename(path))
        for path in sorted(glob.glob(os.path.join(work, "profile_*", "**", "*"),
                                     recursive=True)):
            if os.path.isfile(path) and (path.endswith(".md") or (
                    path.endswith(".trace.json.gz")
                    and os.path.getsize(path) <= TRACE_MAX_BYTES)):
                tar.add(path, arcname=os.path.relpath(path, work))
    return doc


def tiny_models(root: str) -> None:
    """The tiny mode's checkpoints: a llama and a Qwen3.5 hybrid (random, float32), as few
    layers as each kind has (compile time is most of a tiny step, and XLA:CPU's layers are
    unrolled): the hybrid one DeltaNet layer, then one full-attention layer."""
    from tests.checkpoints import make_tiny_checkpoint
    for kind, shape in (("llama", dict(num_hidden_layers=1)),
                        ("qwen3_5", dict(num_hidden_layers=2, full_attention_interval=2))):
        path = os.path.join(root, kind)
        if not os.path.exists(os.path.join(path, "config.json")):
            make_tiny_checkpoint(kind, path, **shape)
        print(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary")
    s.add_argument("--work", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--mode", default="full", choices=["full", "tiny"])
    t = sub.add_parser("tiny-models")
    t.add_argument("--dir", required=True)
    args = ap.parse_args(argv)
    if args.command == "summary":
        summary(args.work, args.out, args.mode)
    else:
        tiny_models(args.dir)


if __name__ == "__main__":
    main()
