"""benchmarks.quant.quantization, part 1: weights and KV per device for each weight x KV
scheme, from the planner (`python -m jaxserve.plan`) and, on TPU targets, from the real
XLA:TPU compiler for the engine LLM would build (jaxserve/planning/plan_compile.py).

Two compiles per TPU scheme, each of one forward program at the smallest token bucket:
- "memory": the engine as LLM builds it (layers under lax.scan, the TPU default; the
  KV cache takes what the weights leave): the compiler's argument bytes vs the planner's.
- "step": the same engine with the Python layer loop and a KV cache of exactly one
  max_model_len sequence. XLA's cost analysis counts a scanned layer body once, and
  charges the in-place KV scatters for the whole cache they write into; unrolled
  layers and an equal small cache make its flops / bytes accessed comparable across
  schemes (still the compiler's estimate, not a TPU measurement).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

GIB = 2**30
LABEL = "compiler estimate on a CPU host, not a TPU measurement"
WEIGHT_SCHEMES = ("none", "fp8", "int8")     # --quantization (none: the model dtype)
KV_SCHEMES = ("auto", "fp8", "int8")         # --kv-cache-dtype (auto: the model dtype)
# What the brief also asked for and jaxserve does not have: a row that says so.
MISSING_MODELS = {"gemma-4-31b": "not in jaxserve (no Gemma model class or built-in config)"}


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    mesh: str
    device: str                 # what the row is for, in words
    target: str | None = None   # a TPU target: usable HBM from it, and compiled
    hbm_bytes: int | None = None  # a GPU's memory (planner only)


CASES = (
    Case("qwen3.6-27b_h100_1x1", "qwen3.6-27b", "1x1", "H100 80 GiB", hbm_bytes=80 * GIB),
    Case("qwen3.6-27b_v6e_1x8", "qwen3.6-27b", "1x8", "TPU v6e x8", target="tpu-v6e"),
    Case("llama-3.1-8b_h100_1x1", "llama-3.1-8b", "1x1", "H100 80 GiB", hbm_bytes=80 * GIB),
    Case("llama-3.1-8b_v5e_1x1", "llama-3.1-8b", "1x1", "TPU v5e x1", target="tpu-v5e"),
)


def scheme_kw(weights: str, kv: str) -> dict[str, Any]:
    return {"quantization": None if weights == "none" else weights, "kv_cache_dtype": kv}


def planner_row(case: Case, weights: str, kv: str, max_model_len: int) -> dict[str, Any]:
    """make_plan exactly as `python -m jaxserve.plan` runs it for these flags."""
    from jaxserve.config import default_max_num_seqs
    from jaxserve.checkpoints.model_names import load_model_config
    from jaxserve.planning.plan import make_plan
    from sharding.tpu_targets import tpu_target

    hbm = tpu_target(case.target).usable_hbm_bytes if case.target else case.hbm_bytes
    where = f"--target {case.target}" if case.target else f"--hbm {case.hbm_bytes // GIB}GiB"
    cmd = (f"python -m jaxserve.plan --model {case.model} --mesh {case.mesh} {where} "
           f"--max-model-len {max_model_len} --kv-cache-dtype {kv}"
           + (f" --quantization {weights}" if weights != "none" else "") + " --json")
    plan = make_plan(load_model_config(case.model), model=case.model, mesh=case.mesh,
                     max_model_len=max_model_len, hbm_bytes=hbm,
                     max_num_seqs=default_max_num_seqs("tpu" if case.target else "gpu"),
                     platform="tpu" if case.target else None, **scheme_kw(weights, kv))
    return {"command": cmd, "weight_dtype": plan.quantization or plan.dtype,
            "kv_dtype": plan.kv_dtype, "hbm_bytes": hbm,
            "weight_bytes_per_device": plan.weight_bytes_per_device,
            "kv_bytes_per_token_per_device": plan.kv_bytes_per_token_per_device,
            "state_bytes_per_seq_per_device": plan.state_bytes_per_seq_per_device,
            "kv_tokens": plan.kv_tokens, "max_concurrency": plan.max_sequences,
            "planner_bytes_per_device": plan.weight_bytes_per_device
            + (plan.cache.total_bytes if plan.cache else 0),
            "memory_fits": plan.memory_fits}


def smallest_forward(programs: list) -> list:
    """The forward at the smallest token bucket and the widest page table: a decode
    step of that many rows, each as long as max_model_len (one program: seconds)."""
    from jaxserve.runner.programs import FORWARD
    fwd = [p for p in programs if p.kind == FORWARD]
    tokens, pages = min(p.tokens for p in fwd), max(p.pages for p in fwd)
    return [p for p in fwd if p.tokens == tokens and p.pages == pages]


def compile_row(case: Case, weights: str, kv: str, max_model_len: int, *,
                step: bool = False) -> dict[str, Any]:
    """One compile (see the module docstring for "memory" vs step=True)."""
    from jaxserve.planning.plan_compile import compile_plan

    extra: dict[str, Any] = {}
    if step:   # unrolled layers, a cache of one max_model_len sequence (+ the null page)
        extra = {"scan_layers": False, "num_pages": -(-max_model_len // 16) + 1}
    t0 = time.perf_counter()
    rep = compile_plan(case.model, target=case.target, mesh=case.mesh, select=smallest_forward,
                       max_model_len=max_model_len, **scheme_kw(weights, kv), **extra)
    out: dict[str, Any] = {
        "wall_seconds": time.perf_counter() - t0, "error": rep.error,
        "engine_weight_bytes_per_device": rep.weight_bytes_per_device,
        "engine_kv_bytes_per_device": rep.kv_bytes_per_device,
        "engine_state_bytes_per_device": rep.state_bytes_per_device,
        "num_pages": rep.num_pages, "planner_bytes_per_device": rep.planner_bytes_per_device,
        "fits": rep.fits, "max_num_seqs": rep.max_num_seqs}
    if rep.programs:
        (p,) = rep.programs
        out.update(tokens=p.tokens, compiled=p.compiled, compile_seconds=p.compile_seconds,
                   argument_bytes=p.argument_bytes, temp_bytes=p.temp_bytes,
                   device_peak_bytes=p.device_peak_bytes, flops=p.flops,
                   bytes_accessed=p.bytes_accessed, optimal_seconds=p.optimal_seconds,
                   error=rep.error or p.error)
    return out


def run_memory(cases: tuple[Case, ...], max_model_len: int, *, compile_memory: bool = True,
               schemes: tuple[tuple[str, str], ...] | None = None,
               step_schemes: tuple[tuple[str, str], ...] | None = None,
               log=print) -> dict[str, Any]:
    """Planner rows for every case x scheme (None: all weight x KV schemes); on TPU cases
    a memory compile of each and a step compile of each of step_schemes (None: all)."""
    from sharding.tpu_targets import tpu_target

    rows, steps = [], []
    schemes = schemes or tuple((w, k) for w in WEIGHT_SCHEMES for k in KV_SCHEMES)
    for case in cases:
        for w, k in schemes:
            row = {"case": case.name, "model": case.model, "device": case.device,
                   "mesh": case.mesh, "target": case.target, "weights": w, "kv": k,
                   "max_model_len": max_model_len,
                   "planner": planner_row(case, w, k, max_model_len), "compiler": None}
            if case.target and compile_memory:
                row["compiler"] = compile_row(case, w, k, max_model_len)
                log(f"  memory {case.name} {w}/{k}: "
                    f"{row['compiler'].get('compile_seconds') or 0:.1f} s compile")
            rows.append(row)
        if not case.target:
            continue
        bw = tpu_target(case.target).hbm_gbps * 1e9
        for w, k in (schemes if step_schemes is None else step_schemes):
            c = compile_row(case, w, k, max_model_len, step=True)
            plan = planner_row(case, w, k, max_model_len)
            rows_ = c.get("tokens") or 0
            # What a decode step of those rows at max_model_len must read at least:
            # the weights once, each row's KV (and a hybrid's state, read and written).
            floor = (plan["weight_bytes_per_device"]
                     + rows_ * max_model_len * plan["kv_bytes_per_token_per_device"]
                     + 2 * rows_ * plan["state_bytes_per_seq_per_device"])
            acc = c.get("bytes_accessed")
            steps.append({"case": case.name, "target": case.target, "weights": w, "kv": k,
                          "weight_dtype": plan["weight_dtype"], "kv_dtype": plan["kv_dtype"],
                          "hbm_gbps": bw / 1e9, **c,
                          "compiler_bytes_ms": None if acc is None else acc / bw * 1e3,
                          "floor_bytes": floor, "floor_ms": floor / bw * 1e3})
            log(f"  step {case.name} {w}/{k}: {c.get('compile_seconds') or 0:.1f} s compile")
    return {"rows": rows, "steps": steps, "missing": MISSING_MODELS, "label": LABEL}


def _gib(n: float | None) -> str | None:
    return None if n is None else f"{n / GIB:.2f}"


_SHORT = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "float8_e4m3fn": "fp8 e4m3",
          "float8_e5m2": "fp8 e5m2"}


def short_dtype(name: str) -> str:
    return _SHORT.get(name, name)


def markdown(res: dict[str, Any]) -> str:
    from benchmarks.shared.results_io import markdown_table

    mem = []
    for r in res["rows"]:
        p, c = r["planner"], r["compiler"] or {}
        arg, pb = c.get("argument_bytes"), c.get("planner_bytes_per_device")
        mem.append([r["model"], r["device"], short_dtype(p["weight_dtype"]),
                    short_dtype(p["kv_dtype"]),
                    _gib(p["weight_bytes_per_device"]), p["kv_bytes_per_token_per_device"],
                    f"{p['kv_tokens']:,}", p["max_concurrency"],
                    _gib(arg) if c else "-",
                    f"{(pb - arg) / 2**20:.0f}" if arg and pb else "-",
                    round(c["compile_seconds"], 1) if c.get("compile_seconds") else "-",
                    (((c.get("error") or "").splitlines() or [""])[0][:90] or None) if c else "-"])
    for model, why in res["missing"].items():
        mem.append([model, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", why])
    step = [[s["case"], short_dtype(s["weight_dtype"]), short_dtype(s["kv_dtype"]),
             s.get("tokens"),
             None if s.get("flops") is None else f"{s['flops'] / 1e9:.0f}",
             _gib(s.get("bytes_accessed")),
             None if s.get("compiler_bytes_ms") is None else round(s["compiler_bytes_ms"], 2),
             _gib(s["floor_bytes"]), round(s["floor_ms"], 2),
             None if s.get("optimal_seconds") is None else f"{s['optimal_seconds']:.3g}",
             round(s["compile_seconds"], 1) if s.get("compile_seconds") else None]
            for s in res["steps"]]
    return "\n\n".join([
        "### Memory per device (planner; TPU rows also compiled)",
        "Weights in GiB per device; KV bytes per token per device; KV tokens = what the "
        "engine's pages hold (90 % of what the weights leave, less the activation reserve); "
        "max concurrency = full-length sequences at once (the planner's max_concurrency); "
        "compiler = the forward program's argument bytes (weights + caches as XLA:TPU "
        f"lays them out; {LABEL}); planner - compiler in MiB (the forward does not take "
        "the lm_head: the sampler does).",
        markdown_table(["model", "device", "weights", "KV", "weights GiB", "KV B/token",
                        "KV tokens", "max concurrency", "compiler arg GiB",
                        "planner - compiler MiB", "compile s", "engine error"], mem),
        "### TPU step estimate (XLA cost analysis of one forward step)",
        "The forward at the smallest token bucket (16 rows) with every row's page table "
        "max_model_len wide, layers unrolled, a cache of one max_model_len sequence; "
        "GFLOP, GiB accessed and ms = bytes accessed / the chip's published HBM "
        "bandwidth, all the compiler's. The attention kernel's cost estimate counts "
        "each row at the page table's full width and XLA charges the in-place KV "
        "writes for the whole cache, so this is an upper bound; floor = weights + "
        "rows x max_model_len x KV bytes per token (+ state) per device over the same "
        "bandwidth. optimal_seconds is the compiler's own time estimate, meaningless "
        "here (XLA:TPU gives scatters negative time).",
        markdown_table(["case", "weights", "KV", "rows", "GFLOP", "GiB accessed",
                        "compiler ms", "floor GiB", "floor ms", "optimal_seconds",
                        "compile s"], step)])
