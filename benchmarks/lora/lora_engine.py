"""A mixed batch of LoRA adapters through the engine on CPU: the base model alone against
1, 4 and 16 distinct adapters.

    python -m benchmarks.lora.lora_engine [--prompts 32] [--prompt-len 64] [--max-tokens 32]
                                     [--rank 16] [--repeats 2]

The small Qwen3 of the CPU figures (hidden 512, 8 layers), float32. Two engines, each
warmed up before the clock: one with LoRA off (the base), one with --enable-lora
--max-loras 16 --max-lora-rank RANK (rank-RANK adapters on every linear projection,
random weights written as PEFT files). The same greedy workload (--prompts requests of
--prompt-len tokens, --max-tokens each, ignore_eos) runs through LLM.generate with the
requests spread evenly over N adapters (0: the LoRA engine's base rows). Prints the
output tokens per second (best of --repeats, prefix cache reset between runs) and the
ratio to the LoRA-off engine, measured in one run; also per second of this process's
CPU time (every thread's), which other processes on a shared machine move less than the
wall time, and the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from benchmarks.shared.common import make_small_qwen3
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
    args = ap.parse_args()
    tmp = os.path.join(tempfile.gettempdir(), "jaxserve-bench-qwen3-small")
    path = make_small_qwen3(tmp)
    adapters = write_adapters(os.path.join(tmp + "-lora", f"r{args.rank}"), path, max(COUNTS),
                              args.rank)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(args.prompt_len)]}
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = dict(dtype="float32", max_model_len=args.prompt_len + args.max_tokens + 16,
                  max_num_seqs=args.prompts, max_num_batched_tokens=max(2048, args.prompts))

    def best(llm: LLM, loras) -> tuple[float, float]:
        """Output tokens per second of wall time and of this process's CPU time (all its
        threads: less moved by other processes on a shared machine), best of --repeats."""
        rates, cpu_rates = [], []
        for _ in range(args.repeats):
            llm.reset_prefix_cache()
            t, c = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            rates.append(n / (time.perf_counter() - t))
            cpu_rates.append(n / (time.process_time() - c))
        return max(rates), max(cpu_rates)

    base = LLM(path, **engine)
    base_rate, base_cpu = best(base, None)
    del base
    llm = LLM(path, enable_lora=True, max_loras=max(COUNTS), max_lora_rank=args.rank, **engine)
    best(llm, [adapters[i % max(COUNTS)] for i in range(args.prompts)])   # every slot loaded
    print(f"{args.prompts} requests x ({args.prompt_len} prompt + {args.max_tokens} output) "
          f"tokens, rank {args.rank}, best of {args.repeats}")
    print(f"  LoRA off                {base_rate:8.1f} tok/s  {base_cpu:8.1f} tok/CPU-s  "
          f"(load average {os.getloadavg()[0]:.1f})")
    rows = [("LoRA on, base rows", None)] + [
        (f"LoRA on, {n:2d} adapters", [adapters[i % n] for i in range(args.prompts)])
        for n in COUNTS]
    for label, loras in rows:
        rate, cpu = best(llm, loras)
        print(f"  {label:22s}  {rate:8.1f} tok/s  {cpu:8.1f} tok/CPU-s  (x{base_rate / rate:.2f} "
              f"the time, x{base_cpu / cpu:.2f} the CPU time; load average "
              f"{os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
