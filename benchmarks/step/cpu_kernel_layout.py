"""XLA:CPU's dot on a weight stored [in, out] (jaxserve's "kernel") or [out, in]
(models/layers.KERNEL_OUT_IN), alone and in a bf16 engine's decode step.

    python -m benchmarks.step.cpu_kernel_layout [--model DIR] [--batch-sizes 16,64] \\
        [--rows 16,64,256,512] [--output-len 48] [--repeats 3] [--json out.json]

Part 1, the dots: 24 distinct [1024, 2816] weights (50 MiB in bf16, past the caches)
times a [rows, 1024] input, float32 results, in both layouts and both dtypes; the
median of 20 calls. Part 2 (with --model): two engines on the same bf16 checkpoint,
one with the loader's store_kernels_out_in replaced by the identity ([in, out]
kernels, as before), TPOT measured as benchmarks/step/async_tpot.py does, alternating
runs; outputs compared.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any
from unittest import mock

from benchmarks.step.async_tpot import _seconds

K, N, NUM_WEIGHTS = 1024, 2816, 24


def dot_ms(rows: int, dtype: str, out_in: bool, calls: int = 20) -> float:
    import jax
    import jax.numpy as jnp
    import numpy as np
    rng = np.random.default_rng(0)
    shape = (N, K) if out_in else (K, N)
    ws = [jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, dtype) for _ in range(NUM_WEIGHTS)]
    x = jnp.asarray(rng.standard_normal((rows, K), np.float32), dtype)
    dims = (((1,), (1,)) if out_in else ((1,), (0,)), ((), ()))

    @jax.jit
    def f(x, ws):
        return sum(jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32) for w in ws)

    f(x, ws).block_until_ready()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        f(x, ws).block_until_ready()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def engine_tpot(model: str, batch_sizes: list[int], output_len: int, repeats: int) -> list[dict]:
    from jaxserve import LLM
    kw = dict(dtype="bfloat16", max_model_len=512, max_num_seqs=max(batch_sizes), seed=0)
    with mock.patch("jaxserve.build.loader.store_kernels_out_in", lambda model, params: params):
        in_out = LLM(model, **kw)
    out_in = LLM(model, **kw)
    rng = random.Random(0)
    rows = []
    for batch in batch_sizes:
        prompts = [[rng.randrange(10, 1000) for _ in range(64)] for _ in range(batch)]
        tpot: dict[str, list[float]] = {"in_out": [], "out_in": []}
        tokens = {}
        for _ in range(repeats):
            for name, llm in (("in_out", in_out), ("out_in", out_in)):
                one, _ = _seconds(llm, prompts, 1)
                full, tokens[name] = _seconds(llm, prompts, output_len)
                tpot[name].append(1e3 * (full - one) / (output_len - 1))
        a, b = statistics.median(tpot["in_out"]), statistics.median(tpot["out_in"])
        rows.append({"batch": batch, "tpot_ms_in_out": round(a, 3), "tpot_ms_out_in": round(b, 3),
                     "speedup": round(a / b, 3), "outputs_equal": tokens["in_out"] == tokens["out_in"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a bf16 checkpoint: also time its decode step")
    ap.add_argument("--rows", default="16,64,256,512")
    ap.add_argument("--batch-sizes", default="16,64")
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result: dict[str, Any] = {"dots": []}
    print("| dtype | rows | [in, out] ms | [out, in] ms | speedup |\n|---|---|---|---|---|")
    for dtype in ("bfloat16", "float32"):
        for rows in map(int, args.rows.split(",")):
            a, b = dot_ms(rows, dtype, False), dot_ms(rows, dtype, True)
            result["dots"].append({"dtype": dtype, "rows": rows, "ms_in_out": round(a, 3),
                                   "ms_out_in": round(b, 3), "speedup": round(a / b, 3)})
            print(f"| {dtype} | {rows} | {a:.2f} | {b:.2f} | {a / b:.2f} |", flush=True)
    if args.model:
        result["engine"] = engine_tpot(args.model, [int(b) for b in args.batch_sizes.split(",")],
                                       args.output_len, args.repeats)
        print("\n| batch | TPOT [in, out] ms | TPOT [out, in] ms | speedup | outputs equal |\n"
              "|---|---|---|---|---|")
        for r in result["engine"]:
            print(f"| {r['batch']} | {r['tpot_ms_in_out']} | {r['tpot_ms_out_in']} | "
                  f"{r['speedup']} | {r['outputs_equal']} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), **result}, f, indent=1)


if __name__ == "__main__":
    main()
