"""Offline throughput: jaxserve vs the PyTorch reference on the same file, on this CPU.

    python -m benchmarks.offline.throughput [--workload decode|prefill|both] [--hf-batch-sizes 16,32,64]

The reference is transformers `generate` in float32 with static batches sorted by
prompt length (left padding), as a careful user would run it, at each batch size
given; the ratio uses the reference's best. Both systems produce exactly
max_tokens per request (eos ignored), and only those "useful" tokens count.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from benchmarks.shared.common import make_small_qwen3, workload


def run_jaxserve(path: str, items, max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    from jaxserve import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model=path, dtype="float32", max_model_len=1024, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens)
    startup = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": it.prompt_token_ids} for it in items]
    params = [SamplingParams(temperature=0.0, max_tokens=it.max_tokens, ignore_eos=True)
              for it in items]
    compiles = llm.engine.num_compilations
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    useful = sum(len(o.outputs[0].token_ids) for o in outs)
    assert useful == sum(it.max_tokens for it in items)
    return dict(seconds=elapsed, useful_tokens=useful, tokens_per_s=useful / elapsed,
                startup_s=startup, compiles_after_warmup=llm.engine.num_compilations - compiles)


def run_transformers(path: str, items, batch_size: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    order = sorted(range(len(items)), key=lambda i: len(items[i].prompt_token_ids))
    useful = computed = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            batch = [items[i] for i in order[b:b + batch_size]]
            width = max(len(it.prompt_token_ids) for it in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for r, it in enumerate(batch):   # left padding
                n = len(it.prompt_token_ids)
                ids[r, width - n:] = torch.tensor(it.prompt_token_ids)
                mask[r, width - n:] = 1
            new = max(it.max_tokens for it in batch)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            assert out.shape[1] - width == new
            useful += sum(it.max_tokens for it in batch)
            computed += len(batch) * new
    elapsed = time.perf_counter() - t0
    return dict(seconds=elapsed, useful_tokens=useful, tokens_per_s=useful / elapsed,
                padded_waste=1 - useful / computed, batch_size=batch_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["decode", "prefill", "both"], default="both")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--hf-batch-sizes", default="16,32,64",
                    help="static batch sizes to try for the reference (its best is used)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(),
                                                         "jaxserve-bench-qwen3-small"))
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--skip-reference", action="store_true",
                    help="run jaxserve only (no ratio), e.g. while tuning")
    args = ap.parse_args()
    path = make_small_qwen3(args.checkpoint)
    names = ["decode", "prefill"] if args.workload == "both" else [args.workload]
    results = {}
    for name in names:
        items = workload(name, args.num_prompts)
        js = run_jaxserve(path, items, args.max_num_seqs, args.max_num_batched_tokens)
        if args.skip_reference:
            print(f"{name}-heavy: jaxserve {js['tokens_per_s']:.1f} tok/s "
                  f"(startup {js['startup_s']:.1f} s)", flush=True)
            continue
        tried = [run_transformers(path, items, int(b)) for b in args.hf_batch_sizes.split(",")]
        hf = max(tried, key=lambda r: r["tokens_per_s"])
        results[name] = dict(jaxserve=js, transformers=hf, transformers_tried=tried,
                             ratio=js["tokens_per_s"] / hf["tokens_per_s"])
        others = ", ".join(f"batch {r['batch_size']}: {r['tokens_per_s']:.1f}" for r in tried)
        print(f"{name}-heavy: jaxserve {js['tokens_per_s']:.1f} tok/s, transformers "
              f"{hf['tokens_per_s']:.1f} tok/s (best of {others}; {hf['padded_waste']:.0%} "
              f"padded waste) -> {results[name]['ratio']:.2f}x; jaxserve compiles after "
              f"warmup: {js['compiles_after_warmup']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
