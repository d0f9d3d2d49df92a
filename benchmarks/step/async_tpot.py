"""Decode TPOT with async scheduling on and off, in the same run.

    python -m benchmarks.step.async_tpot [--model small-qwen3] [--batch-sizes 1,8] \\
        [--output-len 128] [--repeats 5] [--json out.json]

Two engines on the same checkpoint, one with --async-scheduling; the workload
(`batch` requests of a random 64-token prompt, greedy, eos ignored) runs on each in
turn, `--repeats` times, alternating. TPOT = (wall time of output-len tokens - wall time
of one token) / (output-len - 1), per run; the median of the runs is reported, with the
outputs checked equal and the compilations during the runs (must be 0).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from benchmarks.shared.checkpoint import SMALL_QWEN3_ALIAS, resolve


def _seconds(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    from jaxserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SMALL_QWEN3_ALIAS)
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from jaxserve import LLM
    path = resolve(args.model, args.load_format)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engine_args = dict(dtype=args.dtype, max_model_len=64 + args.output_len + 16,
                       max_num_seqs=max(batches), enable_prefix_caching=False)
    llms = {on: LLM(path, async_scheduling=on, **engine_args) for on in (False, True)}
    rng = random.Random(0)
    rows = []
    for b in batches:
        vocab = llms[False].engine.model_config.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(b)]
        tpots: dict[bool, list[float]] = {False: [], True: []}
        outputs, compiled = {}, {}
        for llm in llms.values():   # first use of the shapes: untimed
            _seconds(llm, prompts, args.output_len)
        before = {on: llm.engine.num_compilations for on, llm in llms.items()}
        for _ in range(args.repeats):
            for on, llm in llms.items():
                one, _ = _seconds(llm, prompts, 1)
                full, outputs[on] = _seconds(llm, prompts, args.output_len)
                tpots[on].append((full - one) / (args.output_len - 1))
        compiled = {on: llm.engine.num_compilations - before[on] for on, llm in llms.items()}
        off_ms, on_ms = (1e3 * statistics.median(tpots[k]) for k in (False, True))
        rows.append(dict(batch=b, tpot_ms_off=round(off_ms, 3), tpot_ms_on=round(on_ms, 3),
                         speedup=round(off_ms / on_ms, 3),
                         outputs_equal=outputs[False] == outputs[True],
                         compilations_during_runs=compiled[True] + compiled[False]))
        print(rows[-1], flush=True)
    print(f"\n| batch | TPOT off (ms) | TPOT on (ms) | off / on | outputs equal |\n"
          f"|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['tpot_ms_off']} | {r['tpot_ms_on']} | {r['speedup']} | "
              f"{r['outputs_equal']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
