"""transformers on the same device, as a careful PyTorch user serves a model: random
weights of the model's published config (no file), bf16, SDPA attention, `generate`
with a static KV cache, which transformers compiles with `torch.compile` on CUDA
(its auto-compile: the decode step, inductor, mode reduce-overhead = CUDA graphs).

    python -m benchmarks.gpu.gpu_torch_bench --model llama-3.1-8b --batch-sizes 1,64 \\
        --input-len 1024 --output-len 128 --output DIR/transformers.json

Per batch size, after one untimed run of each shape (which compiles): TTFT = one
generate of 1 new token (prefill + first token), the batch's generate of --output-len
tokens, TPOT = (that - TTFT) / (output-len - 1), output tok/s = batch x output-len /
time; medians of --iters. Random token-id prompts of --input-len, no padding, eos
removed from the generation config (every row makes exactly --output-len tokens). The
JSON is rewritten after each batch size (results_io.ProgressiveResults) and says
whether the compiled call was used (`torch_compile`).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from benchmarks.shared.results_io import ProgressiveResults


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--model", required=True, help="alias (its published config) or checkpoint directory")
    a("--batch-sizes", default="1,64")
    a("--input-len", type=int, default=1024)
    a("--output-len", type=int, default=128)
    a("--dtype", default="bfloat16")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"])
    a("--iters", type=int, default=2)
    a("--seed", type=int, default=0)
    a("--output", required=True)
    return p


def random_model(model: str, dtype: str, device: str) -> Any:
    """The model's architecture with random weights, built on the device (no file)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.shared.checkpoint import resolve
    config = AutoConfig.from_pretrained(resolve(model, "dummy"))
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype),
                                             attn_implementation="sdpa").eval()
    m.generation_config.eos_token_id = None   # ignore eos, as the engine's runs
    m.generation_config.do_sample = False
    for k in ("temperature", "top_p", "top_k"):
        setattr(m.generation_config, k, None)
    return m


def timed_generate(model: Any, ids: Any, new_tokens: int) -> float:
    import torch
    from benchmarks.shared.reference import sync
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, cache_implementation="static", pad_token_id=0)
    sync()
    seconds = time.perf_counter() - t0
    if out.shape[1] - ids.shape[1] != new_tokens:
        raise RuntimeError(f"generate made {out.shape[1] - ids.shape[1]} tokens, "
                           f"wanted {new_tokens}")
    return seconds


def run_batch(model: Any, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    gen = torch.Generator().manual_seed(args.seed + batch)
    vocab = model.config.vocab_size

    def prompts() -> Any:
        return torch.randint(3, vocab, (batch, args.input_len), generator=gen).to(model.device)

    timed_generate(model, prompts(), 1)                 # untimed: compile each shape
    timed_generate(model, prompts(), args.output_len)
    ttft = [timed_generate(model, prompts(), 1) for _ in range(args.iters)]
    full = [timed_generate(model, prompts(), args.output_len) for _ in range(args.iters)]
    t1, tn = statistics.median(ttft), statistics.median(full)
    return {"batch": batch, "input_len": args.input_len, "output_len": args.output_len,
            "ttft_ms": t1 * 1e3, "e2e_ms": tn * 1e3, "e2e_all_ms": [t * 1e3 for t in full],
            "tpot_ms": (tn - t1) / max(1, args.output_len - 1) * 1e3,
            "output_tokens_per_s": batch * args.output_len / tn,
            "torch_compile": hasattr(model, "_compiled_call")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    import torch
    from benchmarks.shared.reference import torch_device
    device = torch_device(args.device)
    torch.manual_seed(args.seed)
    out = ProgressiveResults(args.output, benchmark="gpu_torch_bench", argv=argv,
                             config={**vars(args), "device": device})
    t0 = time.perf_counter()
    model = random_model(args.model, args.dtype, device)
    out.save(load_seconds=time.perf_counter() - t0, batches=[],
             device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu")
    for b in (int(x) for x in args.batch_sizes.split(",") if x):
        res = run_batch(model, b, args)
        print(f"transformers batch {b}: TTFT {res['ttft_ms']:.1f} ms, TPOT "
              f"{res['tpot_ms']:.2f} ms, {res['output_tokens_per_s']:.1f} output tok/s "
              f"(torch.compile: {res['torch_compile']})", flush=True)
        out.save(batches=out.results["batches"] + [res])
    out.done()
    return out.results


if __name__ == "__main__":
    main()
