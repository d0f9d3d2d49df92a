"""Decode step time against context length: what the attention adds per context token.

    python -m benchmarks.step.decode_context --model DIR [--dtype bfloat16] [--rows 48] \\
        [--contexts 8,200,500] [--output-len 48] [--repeats 2] [--json out.json]

For each context length L, `rows` random prompts of L tokens, greedy, eos ignored; the
prompts are run once first, so the timed runs take them from the prefix cache and time
decode steps only: ms/step = (time of output-len tokens - time of 1) / (output-len - 1),
the best of `repeats`. The slope between two lengths is the attention's cost per context
token per step (the rest of the step does not depend on L).
"""
from __future__ import annotations

import argparse
import json
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--contexts", default="8,200,500")
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from jaxserve import LLM, SamplingParams
    contexts = [int(c) for c in args.contexts.split(",")]
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(64, args.rows), seed=0,
              max_model_len=max(contexts) + args.output_len + 16, enable_prefix_caching=True)
    rng = random.Random(0)

    def seconds(prompts: list[dict], n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    rows = []
    print("| context | decode ms/step |\n|---|---|")
    for length in contexts:
        prompts = [{"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(length)]}
                   for _ in range(args.rows)]
        seconds(prompts, 2)   # fills the prefix cache
        best = min((seconds(prompts, args.output_len) - seconds(prompts, 1)) / (args.output_len - 1)
                   for _ in range(args.repeats))
        rows.append({"context": length, "decode_ms_per_step": round(1e3 * best, 2)})
        print(f"| {length}-{length + args.output_len} | {1e3 * best:.1f} |", flush=True)
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        slope = (b["decode_ms_per_step"] - a["decode_ms_per_step"]) / (b["context"] - a["context"])
        print(f"\n{slope:.3f} ms per context token per step at {args.rows} rows")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
