"""Quantization (--quantization fp8|int8, --kv-cache-dtype fp8|fp8_e5m2|int8): memory,
accuracy and CPU speed, in three parts (--parts, default all):

    python -m benchmarks.quant.quantization --output-dir benchmarks/results \\
        [--parts memory,accuracy,speed] [--merge]

- memory (benchmarks/quant/quant_memory.py): weights and KV per device for each weight x KV
  scheme, from the planner, and for TPU targets from the real XLA:TPU compiler (argument
  bytes of the engine's forward; a step's flops / bytes accessed);
- accuracy (benchmarks/quant/quant_accuracy.py): top-1 agreement and |delta logprob| of
  prompt logprobs against the unquantized float32 engine, on tiny random checkpoints
  and a small byte-level Llama trained here (benchmarks/shared/byte_lm.py);
- speed (below): LLM.generate decode throughput on this CPU per scheme, and the TPU
  compiler's step estimate for the same engine on a v6e chip.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.shared.results_io import cpu_snapshot, markdown_table, other_load, write_results

PARTS = ("memory", "accuracy", "speed")
SPEED_SCHEMES = (("none", "auto"), ("fp8", "auto"), ("int8", "auto"), ("none", "fp8"),
                 ("none", "int8"), ("fp8", "fp8"), ("int8", "int8"))
STEP_AXES = (("none", "auto"), ("fp8", "auto"), ("int8", "auto"), ("none", "fp8"),
             ("none", "int8"))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_schemes(text: str) -> tuple[tuple[str, str], ...]:
    """"none/auto,int8/int8" -> (("none", "auto"), ("int8", "int8"))."""
    out = tuple(tuple(s.split("/")) for s in text.split(","))
    if bad := [s for s in out if len(s) != 2]:
        raise ValueError(f"schemes {text!r}: expected weights/kv pairs, got {bad}")
    return out   # type: ignore[return-value]


def run_speed(path: str, schemes: tuple[tuple[str, str], ...], *, num_prompts: int,
              prompt_len: int, output_len: int, repeats: int, tpu_target: str | None,
              seed: int = 0) -> dict[str, Any]:
    """Each scheme's engine (float32 activations) runs the same greedy batch `repeats`
    times (prefix cache reset between); the median counts."""
    import numpy as np

    from benchmarks.shared.common import Item
    from benchmarks.shared.jaxserve_offline import generate, make_llm
    from benchmarks.quant.quant_memory import Case, compile_row

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    rng = np.random.default_rng(seed)
    items = [Item(rng.integers(3, vocab, prompt_len).tolist(), output_len)
             for _ in range(num_prompts)]
    engine = {"dtype": "float32", "max_model_len": prompt_len + output_len + 16,
              "max_num_seqs": num_prompts, "max_num_batched_tokens": 512}
    rows, base_out = [], None
    for w, k in schemes:
        llm, startup = make_llm(path, quantization=None if w == "none" else w,
                                kv_cache_dtype=k, **engine)
        generate(llm, [Item(items[0].prompt_token_ids[:8], 2)], progress=False)   # warmup
        compiles0, secs, steps = llm.engine.num_compilations, [], []
        for _ in range(repeats):
            llm.reset_prefix_cache()
            s0, t0 = llm.engine.num_steps, time.perf_counter()
            out = generate(llm, items, progress=False)
            secs.append(time.perf_counter() - t0)
            steps.append(llm.engine.num_steps - s0)
        base_out = base_out or out
        med = statistics.median(secs)
        row = {"weights": w, "kv": k, "seconds": med, "seconds_each": secs,
               "steps": steps[0], "ms_per_step": med / steps[0] * 1e3,
               "output_tok_s": num_prompts * output_len / med, "startup_s": startup,
               "compiles_during_run": llm.engine.num_compilations - compiles0,
               "greedy_identical_to_first": sum(a == b for a, b in zip(out, base_out))}
        del llm
        if tpu_target:
            row["tpu"] = compile_row(Case("speed", path, "1x1", tpu_target, target=tpu_target),
                                     w, k, engine["max_model_len"], step=True)
        rows.append(row)
        log(f"  speed {w}/{k}: {row['output_tok_s']:.1f} tok/s, {row['ms_per_step']:.1f} ms/step")
    for r in rows:
        r["ratio_vs_first"] = rows[0]["seconds"] / r["seconds"]
    return {"model": path, "engine": engine, "num_prompts": num_prompts,
            "prompt_len": prompt_len, "output_len": output_len, "repeats": repeats,
            "tpu_target": tpu_target, "rows": rows}


def speed_markdown(res: dict[str, Any]) -> str:
    def tpu(r: dict[str, Any], key: str, scale: float) -> str | None:
        v = (r.get("tpu") or {}).get(key)
        return None if v is None else f"{v / scale:.3g}"
    rows = [[r["weights"], r["kv"], f"{r['output_tok_s']:.1f}", f"{r['ratio_vs_first']:.2f}",
             f"{r['ms_per_step']:.1f}", r["steps"], r["compiles_during_run"],
             f"{r['greedy_identical_to_first']}/{res['num_prompts']}",
             tpu(r, "flops", 1e9), tpu(r, "bytes_accessed", 2**20),
             ((r.get("tpu") or {}).get("error") or "").split("\n")[0][:60] or None]
            for r in res["rows"]]
    e = res["engine"]
    return "\n\n".join([
        "### CPU decode speed (LLM.generate, greedy, eos ignored)",
        f"{res['num_prompts']} prompts of {res['prompt_len']} random ids, "
        f"{res['output_len']} output tokens each, one batch (max_num_seqs "
        f"{e['max_num_seqs']}), float32 activations, median of {res['repeats']}; ratio = "
        "the first row's time / this row's (>1: faster); ms/step = median time / engine "
        "steps. TPU columns: the same engine compiled for one "
        f"{res['tpu_target']} chip (layers unrolled, a cache of one max_model_len "
        "sequence; forward at the smallest token bucket): XLA's GFLOP and MiB accessed, "
        "a compiler estimate on a CPU host.",
        markdown_table(["weights", "KV", "out tok/s", "ratio", "ms/step", "steps",
                        "compiles in run", "greedy = first", "TPU GFLOP", "TPU MiB accessed",
                        "TPU error"], rows)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--name", default="quantization")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--merge", action="store_true",
                    help="keep the other parts' results of an earlier <name>.json (each part "
                         "records its own command)")
    ap.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(),
                                                       "jaxserve-bench-quant"),
                    help="checkpoints written once and reused")
    g = ap.add_argument_group("memory")
    g.add_argument("--max-model-len", type=int, default=8192)
    g.add_argument("--cases", default=None, help="names from quant_memory.CASES (default all)")
    g.add_argument("--memory-model", default=None,
                   help="instead of CASES: this checkpoint on --memory-target 1x1")
    g.add_argument("--memory-target", default="tpu-v6e")
    g.add_argument("--no-memory-compile", action="store_true", help="planner only")
    g.add_argument("--memory-schemes", default=None, help="w/kv,...; default all 9")
    g.add_argument("--step-schemes", default="all",
                   help="'all', 'axes' (each axis alone) or w/kv,w/kv,... for step compiles")
    g = ap.add_argument_group("accuracy")
    g.add_argument("--accuracy-models", default="llama,qwen3_moe,qwen3_5,byte-llama")
    g.add_argument("--accuracy-schemes", default=None, help="w/kv,...; default all 11")
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--prompt-len", type=int, default=128)
    g.add_argument("--train-steps", type=int, default=600)
    g = ap.add_argument_group("speed")
    g.add_argument("--speed-model", default="small-qwen3",
                   help="small-qwen3 (benchmarks.shared.common.SMALL_QWEN3) or a checkpoint dir")
    g.add_argument("--speed-schemes", default=None, help="w/kv,...; the first is the baseline")
    g.add_argument("--speed-prompts", type=int, default=32)
    g.add_argument("--speed-prompt-len", type=int, default=16)
    g.add_argument("--speed-output-len", type=int, default=128)
    g.add_argument("--repeats", type=int, default=2)
    g.add_argument("--speed-tpu-target", default="tpu-v6e", help="'' for none")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if unknown := set(parts) - set(PARTS):
        ap.error(f"--parts: unknown {sorted(unknown)}; choose from {PARTS}")

    argv = sys.argv[1:] if argv is None else argv
    results: dict[str, Any] = {}
    for part in parts:
        start = cpu_snapshot()
        results[part] = RUNNERS[part](args)
        # Each part's own command and the load beside it: --merge mixes runs.
        results[part].update(command=shlex.join(["python", "-m", "benchmarks.quant.quantization",
                                                 *argv]),
                             other_processes_cores=other_load(start))
    path = os.path.join(args.output_dir, f"{args.name}.json")
    if args.merge and os.path.exists(path):   # read now: another part may have run beside
        with open(path, encoding="utf-8") as f:
            results = {**json.load(f)["results"], **results}
    md = [MARKDOWN[p](results[p]) for p in PARTS if p in results]
    write_results(args.output_dir, args.name, benchmark="quantization", argv=argv,
                  config=vars(args), results=results, table="\n\n".join(md))


def run_memory_part(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.quant import quant_memory as qm
    cases = qm.CASES if args.cases is None else tuple(
        c for c in qm.CASES if c.name in args.cases.split(","))
    if args.memory_model:
        cases = (qm.Case("toy", args.memory_model, "1x1", args.memory_target,
                         target=args.memory_target),)
    steps = (None if args.step_schemes == "all" else STEP_AXES
             if args.step_schemes == "axes" else parse_schemes(args.step_schemes))
    t0 = time.perf_counter()
    res = qm.run_memory(cases, args.max_model_len, compile_memory=not args.no_memory_compile,
                        schemes=parse_schemes(args.memory_schemes) if args.memory_schemes
                        else None, step_schemes=steps, log=log)
    return {**res, "wall_seconds": time.perf_counter() - t0}


def run_accuracy_part(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.quant import quant_accuracy as qa
    t0 = time.perf_counter()
    subjects = qa.make_subjects(args.work_dir, tuple(args.accuracy_models.split(",")),
                                args.num_prompts, args.prompt_len, args.train_steps, log=log)
    res = qa.run_accuracy(subjects, list(parse_schemes(args.accuracy_schemes))
                          if args.accuracy_schemes else None, log=log)
    return {**res, "wall_seconds": time.perf_counter() - t0}


def run_speed_part(args: argparse.Namespace) -> dict[str, Any]:
    path = args.speed_model
    if path == "small-qwen3":
        from benchmarks.shared.common import make_small_qwen3
        path = make_small_qwen3(os.path.join(tempfile.gettempdir(), "jaxserve-bench-qwen3-small"))
    return run_speed(path, parse_schemes(args.speed_schemes) if args.speed_schemes
                     else SPEED_SCHEMES, num_prompts=args.speed_prompts,
                     prompt_len=args.speed_prompt_len, output_len=args.speed_output_len,
                     repeats=args.repeats, tpu_target=args.speed_tpu_target or None)


def _memory_md(res: dict[str, Any]) -> str:
    from benchmarks.quant.quant_memory import markdown
    return markdown(res)


def _accuracy_md(res: dict[str, Any]) -> str:
    from benchmarks.quant.quant_accuracy import markdown
    return markdown(res)


RUNNERS = {"memory": run_memory_part, "accuracy": run_accuracy_part, "speed": run_speed_part}
MARKDOWN = {"memory": _memory_md, "accuracy": _accuracy_md, "speed": speed_markdown}


if __name__ == "__main__":
    main()
