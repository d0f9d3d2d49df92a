"""What the forward's token-bucket ladder costs in padding: the coarse ladder (powers of
two to 512 tokens, then midpoints) against the fine one (midpoints throughout).

    python -m benchmarks.step.token_buckets --output-dir benchmarks/results

A step of n tokens runs the forward compiled for the smallest bucket >= n. For every n
up to 2048 the step's cost under each ladder is compared, two ways:

- measured on this CPU: the small Qwen3's forward timed at every bucket of the fine
  ladder (zero context, so the projections and MLP: the work padding adds);
- modelled on TPU chips: max(weight bytes / HBM bandwidth, 2 x params x tokens / peak
  bf16 FLOP/s) per device (the roofline), for the flagship on v6e 1x8 and Llama-3.1-8B
  on one v6e, where a step is bound by the weights' reads up to a few hundred tokens.

Reported: the mean and the worst step cost of each ladder over n in 1..256 (decode and
small mixed steps) and 257..2048 (prefill chunks), relative to the fine ladder (CPU)
or to no padding at all (roofline), and how many forward programs each ladder makes.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks.shared.results_io import build_document, markdown_table, write_json

MAX_TOKENS = 2048
RANGES = ((1, 256), (257, MAX_TOKENS))
ROOFLINE_CASES = (("qwen3.6-27b", "1x8", "tpu-v6e"), ("llama-3.1-8b", "1x1", "tpu-v6e"))


def ladders() -> dict[str, tuple[int, ...]]:
    from jaxserve.runner.buckets import midpoint_buckets, token_buckets
    return {"fine (midpoints)": midpoint_buckets(16, MAX_TOKENS),
            "coarse (engine)": token_buckets(MAX_TOKENS)}


def summarise(cost_of_bucket, ideal) -> list[dict[str, Any]]:
    """Per ladder and range: mean and max of cost(bucket(n)) / ideal(n)."""
    from jaxserve.runner.buckets import pick_bucket
    out = []
    for name, ladder in ladders().items():
        for lo, hi in RANGES:
            ratios = [cost_of_bucket(pick_bucket(ladder, n)) / ideal(n) for n in range(lo, hi + 1)]
            out.append({"ladder": name, "programs": len(ladder), "tokens": f"{lo}-{hi}",
                        "mean": float(np.mean(ratios)), "max": float(np.max(ratios))})
    return out


def measure_cpu(iters: int) -> dict[int, float]:
    """Seconds of the small Qwen3's forward per bucket of the fine ladder."""
    import jax

    from benchmarks.shared.common import make_small_qwen3
    from jaxserve import LLM
    from models.inputs import ModelInputs
    path = make_small_qwen3(os.path.join(tempfile.gettempdir(), "jaxserve-bench-qwen3-small"))
    llm = LLM(model=path, dtype="float32", max_model_len=1024, max_num_seqs=64,
              max_num_batched_tokens=MAX_TOKENS)
    runner = llm.engine.runner
    rows, pages = runner.batch.max_num_seqs, runner.batch.page_buckets[-1]
    seconds = {}
    for t in ladders()["fine (midpoints)"]:
        z = np.zeros(t, np.int32)
        inputs = ModelInputs(token_ids=z, positions=z, slot_mapping=z,
                             query_start_loc=np.zeros(rows + 1, np.int32),
                             seq_lens=np.zeros(rows, np.int32),
                             page_table=np.zeros((rows, pages), np.int32),
                             num_seqs=np.zeros(1, np.int32), state_slots=np.zeros(rows, np.int32))
        times = []
        for i in range(iters + 2):           # two warm calls (the first compiles)
            t0 = time.perf_counter()
            out = runner._forward(runner.params, runner.kv_caches, inputs,
                                  np.zeros(rows, np.int32), runner._no_prev_ids,
                                  np.full(len(z), -1, np.int32))
            runner.kv_caches = out[2]
            jax.block_until_ready(out)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        seconds[t] = float(np.median(times))
        print(f"  cpu forward {t:5d} tokens: {seconds[t] * 1e3:.1f} ms", flush=True)
    return seconds


def roofline(model: str, mesh: str, target_name: str):
    """Seconds of a step of n tokens per device on the chip's roofline."""
    from jaxserve.checkpoints.model_names import load_model_config
    from jaxserve.planning.plan import make_plan
    from sharding.tpu_targets import tpu_target
    target = tpu_target(target_name)
    plan = make_plan(load_model_config(model), model=model, mesh=mesh,
                     hbm_bytes=target.usable_hbm_bytes)
    weights_s = plan.weight_bytes_per_device / (target.hbm_gbps * 1e9)
    flops_per_token = 2 * plan.num_params / plan.mesh[1]
    return lambda n: max(weights_s, flops_per_token * n / (target.bf16_tflops * 1e12))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    cpu = measure_cpu(args.iters)
    fine = ladders()["fine (midpoints)"]
    from jaxserve.runner.buckets import pick_bucket
    rows = [{"where": "CPU, small Qwen3 (measured, vs the fine ladder)", **r}
            for r in summarise(lambda b: cpu[b], lambda n: cpu[pick_bucket(fine, n)])]
    for model, mesh, target in ROOFLINE_CASES:
        step = roofline(model, mesh, target)
        rows += [{"where": f"{model} {mesh} {target} (roofline, vs no padding)", **r}
                 for r in summarise(step, step)]
    doc = build_document(benchmark="token_buckets", argv=sys.argv[1:] if argv is None else argv,
                         config={"max_tokens": MAX_TOKENS, "ladders": ladders(),
                                 "iters": args.iters},
                         results={"cpu_forward_seconds": cpu, "padding": rows})
    os.makedirs(args.output_dir, exist_ok=True)
    write_json(os.path.join(args.output_dir, "token_buckets.json"), doc)
    md = markdown_table(["where", "ladder", "forward programs", "tokens", "mean cost", "worst"],
                        [[r["where"], r["ladder"], r["programs"], r["tokens"],
                          f"{r['mean']:.3f}", f"{r['max']:.3f}"] for r in rows])
    with open(os.path.join(args.output_dir, "token_buckets.md"), "w", encoding="utf-8") as f:
        f.write("# Token-bucket padding\n\n" + md + "\n")
    print(md)


if __name__ == "__main__":
    main()
