"""The sampler before and after one-program-per-row-bucket and top-k candidates.

    python -m benchmarks.step.sampler --baseline 7b1f0c2 --output-dir benchmarks/results

The baseline's jaxserve/runner/sampler.py is read from git (`--baseline`, a commit of
the static-variant sampler) and run beside the current one on the same inputs:

- run time on this CPU: one call of each sampler on [rows, V] logits (V = 151,936, the
  Qwen3 vocabulary) for each kind of batch (greedy, plain temperature, top-p, top-k +
  top-p, min-p, logprobs), median of --iters calls; the baseline gets the variant its
  engine chose for that batch, the current one its program (greedy rows alone take
  the greedy program in both: the argmax alone). Two
  kinds of logits: "peaked" (Gaussian, sd 8: top-p 0.9 keeps a handful of tokens, as
  a confident model) and "flat" (sd 3: top-p 0.9 keeps thousands, more than the
  candidates, so the current sampler falls back to the sort);
- compile on a TPU (libtpu's deviceless XLA:TPU compiler on this host, a compiler
  figure, not a TPU measurement): the sampler for 256 rows of the flagship's
  248,320-token vocabulary on a v6e 1x8 mesh, logits vocab-parallel as the lm_head
  leaves them: every static variant of the baseline (8) against the current sampler's
  three programs (greedy, random, penalties); seconds to compile and the compiler's
  temporaries.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks.shared.results_io import REPO, build_document, markdown_table, write_json

CPU_VOCAB, TPU_VOCAB, TPU_ROWS = 151_936, 248_320, 256
LABEL = "compiler figure on a CPU host, not a TPU measurement"


def load_baseline(commit: str):
    """The baseline's sampler module, from git, under another name."""
    src = subprocess.run(["git", "-C", REPO, "show", f"{commit}:jaxserve/runner/sampler.py"],
                         check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "baseline_sampler.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def batches():
    from jaxserve.sampling_params import SamplingParams as P
    return {"greedy": P(temperature=0.0), "temperature": P(temperature=0.8),
            "top_p 0.9": P(temperature=0.8, top_p=0.9),
            "top_k 50 + top_p 0.95": P(temperature=0.8, top_k=50, top_p=0.95),
            "min_p 0.05": P(temperature=0.8, min_p=0.05),
            "logprobs 5 (greedy)": P(temperature=0.0, logprobs=5)}


LOGIT_SCALES = {"peaked": 8.0, "flat": 3.0}


def cpu_times(old, rows: int, iters: int, kind: str) -> list[dict[str, Any]]:
    import jax

    from jaxserve.runner import sampler as new
    from jaxserve.runner import sampling_tensors as tensors_of
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((rows, CPU_VOCAB)) * LOGIT_SCALES[kind]).astype(np.float32)
    old_fn = jax.jit(old.sample, static_argnames=("variant",))
    new_fn = jax.jit(new.sample, static_argnames=("penalties", "greedy"))
    out = []
    for name, params in batches().items():
        sampling_rows = [tensors_of.SamplingRow(params, 0, seed=i) for i in range(rows)]
        variant = old.choose_variant([params])
        mode = {"greedy": True} if new.only_greedy([params]) else {}
        calls = {
            "baseline": lambda: old_fn(logits, old.make_sampling_tensors(
                [old.SamplingRow(params, 0, seed=i) for i in range(rows)], rows, CPU_VOCAB),
                variant=variant),
            "current": lambda: new_fn(logits, tensors_of.make_sampling_tensors(
                sampling_rows, rows, CPU_VOCAB), **mode),
        }
        seconds = {}
        for who, call in calls.items():
            jax.block_until_ready(call())        # compile
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                jax.block_until_ready(call())
                times.append(time.perf_counter() - t0)
            seconds[who] = float(np.median(times))
        out.append({"rows": rows, "logits": kind, "batch": name, "baseline_ms": seconds["baseline"] * 1e3,
                    "current_ms": seconds["current"] * 1e3,
                    "speedup": seconds["baseline"] / seconds["current"]})
        print(f"  cpu {out[-1]}", flush=True)
    return out


def tpu_compiles(old) -> list[dict[str, Any]]:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxserve.runner import sampler as new
    from jaxserve.runner import sampling_tensors as tensors_of
    from sharding.tpu_targets import abstract_tpu_mesh
    mesh = abstract_tpu_mesh("tpu-v6e", "1x8")
    rep = NamedSharding(mesh, PartitionSpec())
    vocab_parallel = NamedSharding(mesh, PartitionSpec(None, "model"))
    logits = jax.ShapeDtypeStruct((TPU_ROWS, TPU_VOCAB), np.float32, sharding=vocab_parallel)

    def spec(tensors):
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tensors)

    def compile_one(fn, tensors) -> dict[str, Any]:
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = jax.jit(fn).lower(logits, spec(tensors)).compile()
        mem = compiled.memory_analysis()
        return {"compile_seconds": time.perf_counter() - t0,
                "temp_bytes": int(mem.temp_size_in_bytes)}

    def old_program(variant):
        def fn(x, t):   # the baseline runner gathered the logits for every non-greedy variant
            if variant != old.SamplerVariant(do_sample=False):
                x = jax.lax.with_sharding_constraint(x, rep)
            return old.sample(x, t, variant)
        return fn

    def new_program(mode):
        gather = lambda x: jax.lax.with_sharding_constraint(x, rep)
        return lambda x, t: new.sample(x, t, penalties=mode == "penalties",
                                       greedy=mode == "greedy", gather=gather)

    out = []
    for flags in itertools.product((False, True), repeat=3):
        v = old.SamplerVariant(*flags)
        tensors = old.make_sampling_tensors([], TPU_ROWS, TPU_VOCAB, penalties=v.penalties,
                                            penalty_len=16)
        out.append({"sampler": "baseline", "program": str(flags), **compile_one(old_program(v), tensors)})
        print(f"  tpu {out[-1]}", flush=True)
    for mode in ("greedy", "random", "penalties"):
        tensors = tensors_of.make_sampling_tensors([], TPU_ROWS, TPU_VOCAB,
                                                   penalties=mode == "penalties", penalty_len=16)
        out.append({"sampler": "current", "program": mode,
                    **compile_one(new_program(mode), tensors)})
        print(f"  tpu {out[-1]}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", required=True, help="git commit of the baseline sampler")
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--rows", default="8,64")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-tpu", action="store_true")
    args = ap.parse_args(argv)
    old = load_baseline(args.baseline)
    cpu = [r for rows in map(int, args.rows.split(",")) for kind in LOGIT_SCALES
           for r in cpu_times(old, rows, args.iters, kind)]
    tpu = [] if args.skip_tpu else tpu_compiles(old)
    doc = build_document(benchmark="sampler", argv=sys.argv[1:] if argv is None else argv,
                         config={"baseline": args.baseline, "cpu_vocab": CPU_VOCAB,
                                 "tpu_vocab": TPU_VOCAB, "tpu_rows": TPU_ROWS,
                                 "iters": args.iters},
                         results={"cpu": cpu, "tpu_compile": tpu, "tpu_label": LABEL})
    os.makedirs(args.output_dir, exist_ok=True)
    write_json(os.path.join(args.output_dir, "sampler.json"), doc)
    md = "# Sampler: baseline (static variants, full sort) vs current\n\n"
    md += "## CPU run time per call (ms, median)\n\n" + markdown_table(
        ["rows", "logits", "batch", "baseline", "current", "speedup"],
        [[r["rows"], r["logits"], r["batch"], f"{r['baseline_ms']:.2f}", f"{r['current_ms']:.2f}",
          f"{r['speedup']:.2f}x"] for r in cpu]) + "\n"
    if tpu:
        md += (f"\n## Compile for v6e 1x8, {TPU_ROWS} rows x {TPU_VOCAB} ({LABEL})\n\n"
               + markdown_table(["sampler", "program", "compile s", "temp GiB"],
                                [[r["sampler"], r["program"], f"{r['compile_seconds']:.1f}",
                                  f"{r['temp_bytes'] / 2**30:.2f}"] for r in tpu]))
        for who in ("baseline", "current"):
            total = sum(r["compile_seconds"] for r in tpu if r["sampler"] == who)
            md += f"\n{who}: {total:.1f} s for all its sampler programs at {TPU_ROWS} rows"
        md += "\n"
    with open(os.path.join(args.output_dir, "sampler.md"), "w", encoding="utf-8") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
