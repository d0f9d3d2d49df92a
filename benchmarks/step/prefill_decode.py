"""One prefill step and the decode steps after it, timed apart, on a model of Qwen3-8B's
layer widths (benchmarks/shared/common.base_model's "8b").

    python -m benchmarks.step.prefill_decode [--layers 2] [--rows 16] [--prompt-len 64]
                                             [--output-len 16] [--repeats 4]

`rows` prompts of `prompt-len` random tokens, greedy, ignore_eos, prefix cache reset
before each run: prefill = the best time of a 1-token run (its prefill step), decode =
(best time of an output-len run - prefill) / (output-len - 1). For A/B runs of an
environment switch (e.g. JAXSERVE_CPU_MALLOC=default against unset), one process each.
"""
from __future__ import annotations

import argparse
import random
import time

from benchmarks.shared.common import base_model
from jaxserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    path = base_model("8b", args.layers, "bfloat16")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(args.prompt_len)]}
               for _ in range(args.rows)]
    llm = LLM(path, dtype="bfloat16", max_model_len=args.prompt_len + args.output_len + 16,
              max_num_seqs=args.rows, max_num_batched_tokens=max(2048, args.rows))

    def best(n: int) -> float:
        times = []
        for _ in range(args.repeats):
            llm.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                         use_tqdm=False)
            times.append(time.perf_counter() - t)
        return min(times)

    prefill = best(1)
    decode = (best(args.output_len) - prefill) / (args.output_len - 1)
    print(f"{path}: {args.rows} x {args.prompt_len} prompt tokens: prefill {1e3 * prefill:.1f} ms, "
          f"decode {1e3 * decode:.1f} ms/step", flush=True)


if __name__ == "__main__":
    main()
