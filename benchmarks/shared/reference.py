"""The PyTorch reference as a careful user runs it: transformers `generate`, greedy.

Static batches of prompts sorted by length (longest first, so a batch too large for
the device fails at once), left padding, `torch.inference_mode`, SDPA attention,
and a static KV cache only where a probe shows it is faster. Each batch runs to its
longest output; only each request's own output length counts as useful tokens.
EOS is removed from the generation config, so like jaxserve's `ignore_eos` it neither
stops a row nor is banned (min_new_tokens would ban it and change greedy outputs).
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from benchmarks.shared.common import Item

PROBE_NEW_TOKENS = 64   # decode length of the static-vs-dynamic cache probe


def torch_device(requested: str = "auto") -> str:
    import torch
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def set_threads(n: int | None) -> int:
    """torch's intra-op threads (None: its default); returns the number in use. On a CPU
    shared with a busy process, fewer threads than cores can be several times faster:
    torch's OpenMP workers wait for each other at every op."""
    import torch
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def load_model(path: str, dtype: str, device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    # .to() rather than device_map=: the latter needs accelerate
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").to(device).eval()
    model.generation_config.eos_token_id = None   # ignore_eos
    model.generation_config.do_sample = False
    for k in ("temperature", "top_p", "top_k"):   # a checkpoint's sampling defaults
        setattr(model.generation_config, k, None)
    return model


def free_gpu_memory() -> None:
    """Give the GPU memory the reference's dropped tensors held back to the device before
    jaxserve allocates its own (the caller drops its model first). On CPU there is
    nothing to give back: tensors go with their last reference, and a gc.collect() would
    walk the whole heap (seconds a call inside a long test worker)."""
    import torch
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    import torch
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def generate_batch(model: Any, batch: list[Item], pad_id: int, cache: str,
                   new_tokens: int | None = None) -> list[list[int]]:
    """Greedy outputs of one left-padded batch; every row runs to the longest output."""
    import torch
    width = max(len(it.prompt_token_ids) for it in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for r, it in enumerate(batch):
        n = len(it.prompt_token_ids)
        ids[r, width - n:] = torch.tensor(it.prompt_token_ids)
        mask[r, width - n:] = 1
    new = new_tokens or max(it.max_tokens for it in batch)
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             do_sample=False, max_new_tokens=new, min_new_tokens=new,
                             pad_token_id=pad_id, **extra)
    if out.shape[1] - width != new:
        raise RuntimeError(f"reference produced {out.shape[1] - width} tokens, wanted {new}")
    rows = out[:, width:].tolist()
    return [row[:it.max_tokens] for row, it in zip(rows, batch)]


def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def probe_cache(model: Any, batch: list[Item], pad_id: int) -> dict[str, Any]:
    """Times one batch with each cache (after one untimed run, which on a GPU also
    compiles the static-cache decode step); the faster one is used."""
    new = min(PROBE_NEW_TOKENS, max(it.max_tokens for it in batch))
    seconds = {}
    for cache in ("dynamic", "static"):
        generate_batch(model, batch, pad_id, cache, new)
        sync()
        t0 = time.perf_counter()
        generate_batch(model, batch, pad_id, cache, new)
        sync()
        seconds[cache] = time.perf_counter() - t0
    return {"chosen": min(seconds, key=seconds.get), "seconds": seconds,
            "batch_size": len(batch), "new_tokens": new}


@dataclass
class RefRun:
    batch_size: int
    cache: str
    seconds: float = 0.0
    seconds_each: list[float] = field(default_factory=list)  # with repeats (median: seconds)
    outputs: list[list[int]] = field(default_factory=list)   # in workload order
    padded_fraction: float = 0.0   # decode rows computed past their request's output
    probe: dict[str, Any] | None = None


def run_static_batches(model: Any, items: list[Item], batch_size: int, pad_id: int,
                       cache: str) -> RefRun:
    """Probe the cache if asked ("auto"), warm up, then time every batch."""
    order = sorted(range(len(items)), key=lambda i: -len(items[i].prompt_token_ids))
    batches = [order[b:b + batch_size] for b in range(0, len(order), batch_size)]
    run = RefRun(batch_size, cache)
    if cache == "auto":
        run.probe = probe_cache(model, [items[i] for i in batches[0]], pad_id)
        run.cache = run.probe["chosen"]
    generate_batch(model, [items[order[-1]]], pad_id, run.cache, 4)   # one-time set-up
    outputs: list[list[int]] = [[] for _ in items]
    useful = computed = 0
    sync()
    t0 = time.perf_counter()
    for batch in tqdm(batches, desc=f"reference (batch {batch_size})", leave=False):
        rows = generate_batch(model, [items[i] for i in batch], pad_id, run.cache)
        for i, row in zip(batch, rows):
            outputs[i] = row
        useful += sum(items[i].max_tokens for i in batch)
        computed += len(batch) * max(items[i].max_tokens for i in batch)
    sync()
    run.seconds = time.perf_counter() - t0
    run.outputs, run.padded_fraction = outputs, 1 - useful / computed
    return run


def candidate_sizes(spec: str, num_prompts: int, max_batch: int) -> tuple[list[int], bool]:
    """(sizes to try, largest-that-fits?) for --ref-batch-size: "auto" tries descending
    powers of two from the workload size and keeps the first that fits; "8,16" times
    each and keeps the fastest."""
    if spec == "auto":
        top = 1
        while top < min(num_prompts, max_batch):
            top *= 2
        top = min(top, max_batch)
        sizes = []
        while top >= 1:
            sizes.append(top)
            top //= 2
        return sizes, True
    sizes = sorted({int(s) for s in spec.split(",")}, reverse=True)
    if not sizes or sizes[-1] < 1:
        raise ValueError(f"--ref-batch-size: 'auto' or positive ints, got {spec!r}")
    return sizes, False


def run_reference(model: Any, items: list[Item], sizes: list[int], first_fit: bool,
                  pad_id: int, cache: str) -> tuple[RefRun, list[dict[str, Any]]]:
    """The chosen run and a record of every size tried (out of memory included)."""
    import torch
    tried: list[dict[str, Any]] = []
    runs: list[RefRun] = []
    for bs in sizes:
        run = None
        try:
            run = run_static_batches(model, items, bs, pad_id, cache)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_oom(e):
                raise
        if run is None:   # out of the except block: its traceback no longer pins tensors
            free_gpu_memory()
            tried.append({"batch_size": bs, "out_of_memory": True})
            continue
        tried.append({"batch_size": bs, "cache": run.cache, "seconds": run.seconds,
                      "padded_fraction": run.padded_fraction, "probe": run.probe})
        runs.append(run)
        if first_fit:
            break
    if not runs:
        raise RuntimeError(f"the reference ran out of memory at every batch size {sizes}")
    return min(runs, key=lambda r: r.seconds), tried
