"""One offline run of `vllm_cpu.py`, in a process of its own: jaxserve (the project's
venv) or vLLM (its own venv, `vllm_cpu_env.py`), the same workload file, the same
engine limits, greedy with eos ignored.

    python -m benchmarks.vllm_cpu.vllm_cpu_run --system vllm|jaxserve --model DIR --dtype DT \\
        --workload IN.json --out OUT.json [--max-model-len N --max-num-seqs N \\
        --max-num-batched-tokens N --repeats N]

Start-up (weights, KV cache, compilation) and one short warmup request are outside
the timing; `repeats` runs the workload again on the same engine with its prefix cache
reset first. Only the standard library is imported at the top: the vLLM venv has no
jax, the project's has no vLLM. vLLM starts its engine in a child process, which
re-imports the main module when it spawns: hence the `__main__` guard.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from benchmarks.vllm_cpu.vllm_cpu_workload import check_lengths, read_workload


def run_vllm(args: argparse.Namespace, items: list[dict[str, Any]]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              seed=args.seed)
    startup = time.perf_counter() - t0

    def generate(batch: list[dict[str, Any]]) -> list[list[int]]:
        prompts = [TokensPrompt(prompt_token_ids=it["prompt_token_ids"]) for it in batch]
        params = [SamplingParams(temperature=0.0, max_tokens=it["max_tokens"], ignore_eos=True)
                  for it in batch]
        return [list(o.outputs[0].token_ids)
                for o in llm.generate(prompts, params, use_tqdm=False)]

    generate([{"prompt_token_ids": items[0]["prompt_token_ids"][:8], "max_tokens": 2}])
    seconds, outputs = [], []
    for _ in range(args.repeats):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        got = generate(items)
        seconds.append(time.perf_counter() - t0)
        check_lengths(got, items, "vllm")
        outputs = outputs or got
    return {"seconds_each": seconds, "startup_s": startup, "outputs": outputs,
            "compiles_during_run": None}


def run_jaxserve(args: argparse.Namespace, items: list[dict[str, Any]]) -> dict[str, Any]:
    from benchmarks.shared.common import Item
    from benchmarks.shared.jaxserve_offline import run_jaxserve as run
    engine_args = dict(dtype=args.dtype, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed)
    res = run(args.model, [Item(it["prompt_token_ids"], it["max_tokens"]) for it in items],
              progress=False, repeats=args.repeats, **engine_args)
    return {"seconds_each": res.seconds_each, "startup_s": res.startup_s,
            "outputs": res.outputs, "compiles_during_run": res.compiles_during_run}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=("vllm", "jaxserve"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    items = read_workload(args.workload)
    res = (run_vllm if args.system == "vllm" else run_jaxserve)(args, items)
    res["seconds"] = statistics.median(res["seconds_each"])
    res["system"] = args.system
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
