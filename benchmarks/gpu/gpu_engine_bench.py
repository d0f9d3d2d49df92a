"""One engine as `jaxserve serve MODEL --load-format dummy ...` starts it, measured the
way vLLM's offline benchmarks measure: start-up (seconds, warmup programs), offline
throughput at one input / output length for each number of concurrent rows (all
given to one LLM.generate, as `vllm bench throughput --num-prompts R` with
max_num_seqs >= R), batch-1 TTFT and TPOT, and the compilations after warmup (0
expected: a compile while serving is a stall a user sees).

    python -m benchmarks.gpu.gpu_engine_bench --model llama-3.1-8b --dtype bfloat16 \\
        [--quantization fp8 --kv-cache-dtype fp8] --rows 1,64,256 --input-len 1024 \\
        --output-len 128 --output DIR/llama_bf16.json

Every jaxserve engine flag is taken (the server's); --max-num-seqs defaults to the
largest --rows, --max-model-len to input + output, --load-format to dummy. The JSON
is rewritten after each measurement (results_io.ProgressiveResults): a run stopped by
a time limit keeps its start-up and the rows it finished. TTFT: one request of
--input-len tokens and max_tokens 1 (prefill + first sample); TPOT: (time of
--output-len tokens - TTFT) / (output-len - 1); each the median of --iters fresh
prompts, the prefix cache reset before each. Sampling is vLLM's benchmark sampling
(temperature 1, eos ignored), so every request makes exactly its output length.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from typing import Any

from benchmarks.shared.results_io import ProgressiveResults
from jaxserve.bench import offline, throughput
from jaxserve.bench.datasets import Prompt, random_ids
from jaxserve.config.engine_args import FLAGS, add_engine_args, engine_kwargs

LOG_LINES = 200   # the engine's start-up log kept in the JSON (its kernel choices are there)


class LogTail(logging.Handler):
    """The jaxserve logger's INFO lines, kept for the results."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) < LOG_LINES:
            self.lines.append(record.getMessage()[:500])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--model", required=True, help="alias, repo id or checkpoint directory")
    a("--rows", default="1,64,256", help="concurrent rows of the throughput runs")
    a("--input-len", type=int, default=1024)
    a("--output-len", type=int, default=128)
    a("--latency", action=argparse.BooleanOptionalAction, default=True,
      help="batch-1 TTFT and TPOT")
    a("--iters", type=int, default=3, help="prompts per TTFT / TPOT median")
    a("--profile-dir", default=None,
      help="trace decode steps with jax.profiler into this folder and summarise them "
           "(benchmarks/gpu/trace_summary.py): where a step's time goes")
    a("--profile-rows", default="1", help="concurrent rows of each traced run")
    a("--profile-steps", type=int, default=12, help="decode steps summarised per trace")
    a("--scan-layers", choices=("auto", "on", "off"), default="auto",
      help="the layers under jax.lax.scan (on) or a Python loop (off); auto: the "
           "platform's choice (LLM's scan_layers)")
    a("--output", required=True, help="the JSON to write")
    add_engine_args(p, FLAGS, defaults={"load_format": "dummy"})
    return p


def engine_args(args: argparse.Namespace, rows: list[int]) -> dict[str, Any]:
    kw = engine_kwargs(args)
    kw.setdefault("max_num_seqs", None)
    kw["max_num_seqs"] = kw["max_num_seqs"] or max(rows)
    page = kw.get("page_size") or 16
    kw["max_model_len"] = kw.get("max_model_len") or \
        -(-(args.input_len + args.output_len) // page) * page
    if args.scan_layers != "auto":
        kw["scan_layers"] = args.scan_layers == "on"
    return kw


def startup_figures(llm: Any, seconds: float) -> dict[str, Any]:
    info = llm.engine.info
    plan = info.cache_plan
    return {"seconds": seconds, "warmup_seconds": info.warmup_seconds,
            "warmup_programs": info.warmup_compilations,
            "warmup_fresh_compilations": info.warmup_fresh_compilations,
            "warmup_cache_hits": info.warmup_cache_hits,
            "weight_bytes_per_device": info.weight_bytes_per_device,
            "kv_bytes": plan.kv_bytes, "num_pages": plan.num_pages,
            "cache_plan": plan.describe()}


def throughput_run(llm: Any, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    targs = throughput.parse(["--input-len", str(args.input_len), "--output-len",
                              str(args.output_len), "--num-prompts", str(rows),
                              "--disable-detokenize", "--disable-tqdm", "--seed", "0"])
    return {"rows": rows, **throughput.run(llm, targs)}


def latency_run(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Batch-1 TTFT and TPOT (module doc), medians."""
    vocab = llm.engine.inputs.vocab_size
    rng = random.Random(1)
    before = llm.engine.num_compilations

    def one(max_tokens: int) -> float:
        llm.reset_prefix_cache()
        p = Prompt(random_ids(rng, args.input_len, vocab), args.input_len, max_tokens)
        return offline.generate(llm, [p], 1, False)[0]

    one(args.output_len)   # untimed: the batch-1 programs' first run
    ttft = [one(1) for _ in range(args.iters)]
    e2e = [one(args.output_len) for _ in range(args.iters)]
    t1, tn = statistics.median(ttft), statistics.median(e2e)
    return {"input_len": args.input_len, "output_len": args.output_len,
            "ttft_ms": t1 * 1e3, "ttft_all_ms": [t * 1e3 for t in ttft],
            "e2e_ms": tn * 1e3, "e2e_all_ms": [t * 1e3 for t in e2e],
            "tpot_ms": (tn - t1) / max(1, args.output_len - 1) * 1e3,
            "compilations_during_run": llm.engine.num_compilations - before}


def profile_run(llm: Any, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    """`rows` requests prefilled untraced, then --profile-steps steps traced while every
    row decodes (the engine driven step by step), summarised per kernel; the requests
    are aborted after."""
    import jax

    from benchmarks.gpu import trace_summary
    from jaxserve.bench.offline import sampling_params
    engine, vocab = llm.engine, llm.engine.inputs.vocab_size
    rng = random.Random(2)
    folder = os.path.join(args.profile_dir, f"rows{rows}")
    llm.reset_prefix_cache()
    ids = [f"profile-{rows}-{i}" for i in range(rows)]
    # As many tokens as fit: no row finishes inside the traced steps, whenever it started
    # (checked below: every row still decoding at the end).
    params = sampling_params(1, engine.inputs.max_model_len - args.input_len, False)
    for rid in ids:
        engine.add_request(engine.inputs.process(rid, random_ids(rng, args.input_len, vocab),
                                                 params))
    sched = engine.scheduler
    try:
        while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                   for r in sched.running):
            engine.step()
        running = len(sched.running)
        with jax.profiler.trace(folder):
            for _ in range(args.profile_steps + 1):
                engine.step()
        if len(sched.running) != rows:
            return {"rows": rows, "error": f"{rows - len(sched.running)} of {rows} rows "
                    "finished inside the traced steps: raise --max-model-len"}
    finally:
        for rid in ids:
            engine.abort_request(rid)
    path = trace_summary.trace_file(folder)
    if path is None:
        return {"rows": rows, "error": f"no trace written under {folder}"}
    summary = trace_summary.summarise(path, args.profile_steps)
    with open(os.path.join(args.profile_dir, f"rows{rows}.md"), "w") as f:
        f.write(trace_summary.markdown(summary, f"{args.model}, {rows} rows decoding"))
    return {"rows": rows, "rows_at_trace_start": running, **summary}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r]
    kw = engine_args(args, rows)
    out = ProgressiveResults(args.output, benchmark="gpu_engine_bench", argv=argv,
                             config={"model": args.model, "rows": rows,
                                     "input_len": args.input_len,
                                     "output_len": args.output_len, "engine": kw})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    tail = LogTail()
    logging.getLogger("jaxserve").addHandler(tail)
    from jaxserve import LLM   # after the flags: JAX starts with the engine's memory pool
    t0 = time.perf_counter()
    llm = LLM(args.model, **kw)
    started = llm.engine.num_compilations
    out.save(startup=startup_figures(llm, time.perf_counter() - t0), log=tail.lines,
             device=llm_device(), throughput=[], profile=[])
    # Batch-1 latency and the profile first: the figures a time limit must not cut.
    if args.latency:
        lat = latency_run(llm, args)
        print(f"batch 1: TTFT {lat['ttft_ms']:.1f} ms, TPOT {lat['tpot_ms']:.2f} ms", flush=True)
        out.save(latency=lat)
    if args.profile_dir:
        for r in [int(x) for x in args.profile_rows.split(",") if x]:
            prof = profile_run(llm, r, args)
            print(f"profile, {r} rows: " + json.dumps(
                {k: prof.get(k) for k in ("wall_ms_per_step", "host_await_ms_per_step")}),
                flush=True)
            out.save(profile=out.results["profile"] + [prof])
    for r in rows:
        res = throughput_run(llm, r, args)
        print(throughput.report(res), flush=True)
        out.save(throughput=out.results["throughput"] + [res])
    out.done(compilations_after_warmup=llm.engine.num_compilations - started, log=tail.lines)
    return out.results


def llm_device() -> str:
    import jax
    d = jax.devices()[0]
    return f"{d.platform}:{d.device_kind}"


if __name__ == "__main__":
    main()
