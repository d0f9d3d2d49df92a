"""A mixed batch of LoRA adapters through the engine on CPU: the base model alone against
1, 4 and 16 distinct adapters.

    python -m benchmarks.lora.lora_engine [--prompts 32] [--prompt-len 64] [--max-tokens 32]
                                     [--rank 16] [--repeats 2] [--shape small|8b]
                                     [--layers N] [--dtype float32|bfloat16]
                                     [--lora-dtype auto|float32|bfloat16]

--shape small (default): the small Qwen3 of the CPU figures (hidden 512, 8 layers).
--shape 8b: Qwen3-8B's layer widths (hidden 4096, MLP 12288, 32 query / 8 kv heads of
128) with --layers of them (default 2): the adapters' share of a step's bytes is set by
the widths (rank x (in + out) against in x out per projection), so a 512-wide model
overstates what 16 adapters cost a real one about eightfold. Two engines, each
warmed up before the clock: one with LoRA off (the base), one with --enable-lora
--max-loras 16 --max-lora-rank RANK (rank-RANK adapters on every linear projection,
random weights written as PEFT files), both held at once. The same greedy workload
(--prompts requests of --prompt-len tokens, --max-tokens each, ignore_eos) runs through
LLM.generate with the requests spread evenly over N adapters (0: the LoRA engine's base
rows), the cases in turn, --repeats rounds. Prints the output tokens per second (best
of the rounds, prefix cache reset between runs) and the ratio to the LoRA-off engine,
measured in one run; also per second of this process's CPU time (every thread's), which
other processes on a shared machine move less than the wall time; the median over the
rounds of each round's time ratio to LoRA off (paired); and the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from benchmarks.shared.common import base_model
from jaxserve import LLM, LoRARequest, SamplingParams
from models.config import ModelConfig
from models.lora.targets import lora_targets
from models.registry import build_model

COUNTS = (1, 4, 16)
def write_adapters(path: str, base: str, num: int, rank: int) -> list[LoRARequest]:
    """`num` random rank-`rank` PEFT adapters over every projection of the model."""
    cfg = ModelConfig.from_pretrained(base)
    targets = lora_targets(build_model(cfg, jnp.float32), cfg)
    rng = np.random.default_rng(0)
    out = []
    for i in range(1, num + 1):
        d = os.path.join(path, f"adapter{i}")
        os.makedirs(d, exist_ok=True)
        tensors = {}
        for name, t in targets.items():
            key = f"base_model.model.model.{name}"
            tensors[key + ".lora_A.weight"] = (rng.standard_normal((rank, t.in_dim)) * 0.02
                                               ).astype(np.float32)
            tensors[key + ".lora_B.weight"] = (rng.standard_normal((t.out_dim, rank)) * 0.02
                                               ).astype(np.float32)
        save_file(tensors, os.path.join(d, "adapter_model.safetensors"))
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": "all-linear", "base_model_name_or_path": base}, f)
        out.append(LoRARequest(f"adapter{i}", i, d))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--shape", choices=("small", "8b"), default="small")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--lora-dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    args = ap.parse_args()
    path = base_model(args.shape, args.layers, args.dtype)
    adapters = write_adapters(os.path.join(path + "-lora", f"r{args.rank}"), path, max(COUNTS),
                              args.rank)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(args.prompt_len)]}
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = dict(dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 16,
                  max_num_seqs=args.prompts, max_num_batched_tokens=max(2048, args.prompts))

    def once(llm: LLM, loras) -> tuple[float, float]:
        """Output tokens per second of wall time and of this process's CPU time (all its
        threads: less moved by other processes on a shared machine)."""
        llm.reset_prefix_cache()
        t, c = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        return n / (time.perf_counter() - t), n / (time.process_time() - c)

    base = LLM(path, **engine)
    llm = LLM(path, enable_lora=True, max_loras=max(COUNTS), max_lora_rank=args.rank,
              lora_dtype=args.lora_dtype, **engine)
    rows = [("LoRA off", base, None), ("LoRA on, base rows", llm, None)] + [
        (f"LoRA on, {n:2d} adapters", llm, [adapters[i % n] for i in range(args.prompts)])
        for n in COUNTS]
    once(base, None)
    once(llm, [adapters[i % max(COUNTS)] for i in range(args.prompts)])   # every slot loaded
    # Round robin over the cases: a slow spell of the shared machine lands on every case
    # alike, not on one engine's runs. Reported: the best of --repeats per case, and the
    # median over the rounds of each case's time against LoRA off's in the same round
    # (paired: steadier than the best-of ratio, which one lucky run moves).
    runs: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in rows}
    for _ in range(args.repeats):
        for label, runner, loras in rows:
            runs[label].append(once(runner, loras))
    print(f"{path}: {args.dtype} (LoRA stacks: {args.lora_dtype}), {args.prompts} requests "
          f"x ({args.prompt_len} prompt + {args.max_tokens} output) tokens, rank {args.rank}, "
          f"{args.repeats} rounds (load average {os.getloadavg()[0]:.1f})")
    best = {label: tuple(max(v) for v in zip(*r)) for label, r in runs.items()}
    base_rate, base_cpu = best["LoRA off"]
    for label, _, _ in rows:
        rate, cpu = best[label]
        paired = statistics.median(b[0] / r[0] for b, r in zip(runs["LoRA off"], runs[label]))
        ratio = "" if label == "LoRA off" else \
            (f"  (best: x{base_rate / rate:.2f} the time, x{base_cpu / cpu:.2f} the CPU time;"
             f" paired median x{paired:.2f} the time)")
        print(f"  {label:22s}  {rate:8.1f} tok/s  {cpu:8.1f} tok/CPU-s{ratio}")

if __name__ == "__main__":
    main()
