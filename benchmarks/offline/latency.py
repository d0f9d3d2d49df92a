"""Batch-1 latency: TTFT against prompt length, and TPOT, for jaxserve and the reference.

    python -m benchmarks.offline.latency --model DIR|ALIAS [--load-format dummy] [--dtype bfloat16] \\
        [--prompt-lens 128,512,2048] [--tpot-prompt-len 128] [--output-len 256] \\
        [--roofline roofline.json] --output-dir DIR

TTFT(L): the time of a request for one token with a fresh random prompt of L tokens
(prefill + first sample), median of `--iters`. TPOT: (time of N tokens - time of one
token) / (N - 1) on the same prompt length, median. jaxserve runs one sequence, its
whole prompt in one step and no prefix caching (a repeated prompt must not hit a cache).
With `--roofline`: TPOT's % of the memory roofline = (weight bytes + the KV bytes of the
mean context) / measured copy bandwidth, over TPOT; TTFT's % of the compute roofline =
weight matmul FLOPs of the prompt / measured matmul FLOP/s, over TTFT.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from benchmarks.shared import agreement as agree
from benchmarks.shared import checkpoint, reference
from benchmarks.shared.common import Item
from benchmarks.shared.jaxserve_offline import generate as js_generate
from benchmarks.shared.jaxserve_offline import make_llm
from benchmarks.shared.model_stats import ModelStats, model_stats
from benchmarks.shared.results_io import markdown_table, new_figure, write_results
from benchmarks.shared.roofline import load_roofline
from jaxserve.bench.datasets import random_ids

Generate = Callable[[Item], list[int]]   # one batch-1 request -> its output tokens


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--model", required=True)
    a("--load-format", default="auto", choices=["auto", "dummy"])
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    a("--prompt-lens", default="128,512,2048", help="TTFT prompt lengths; too long ones skipped")
    a("--tpot-prompt-len", type=int, default=128)
    a("--output-len", type=int, default=256, help="decode length of the TPOT measurement")
    a("--iters", type=int, default=3)
    a("--seed", type=int, default=0)
    a("--roofline", default=None, help="roofline.json of benchmarks.shared.roofline")
    a("--skip-reference", action="store_true")
    a("--ref-cache", default="auto", choices=["auto", "dynamic", "static"])
    a("--ref-device", default="auto", choices=["auto", "cpu", "cuda"])
    a("--ref-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    a("--weights-dir", default=None)
    a("--output-dir", required=True)
    a("--name", default="latency")
    return p


def prompts(length: int, count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(f"{seed}-{length}")   # the same prompts for both systems
    return [random_ids(rng, length, vocab) for _ in range(count)]


def timed(fn: Generate, item: Item) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    out = fn(item)
    return time.perf_counter() - t0, out


def measure(fn: Generate, lens: list[int], args: argparse.Namespace, vocab: int,
            label: str) -> dict[str, Any]:
    """TTFT per prompt length and TPOT, medians; the TPOT runs' outputs for agreement."""
    res: dict[str, Any] = {"ttft_ms": {}, "ttft_all_ms": {}}
    bar = tqdm(total=len(lens) + 1, desc=f"{label} latency", leave=False)
    for n in lens:
        ps = prompts(n, args.iters + 1, vocab, args.seed)
        fn(Item(ps[0], 1))   # warmup at this length
        times = [timed(fn, Item(p, 1))[0] for p in ps[1:]]
        res["ttft_ms"][n] = 1e3 * statistics.median(times)
        res["ttft_all_ms"][n] = [1e3 * t for t in times]
        bar.update(1)
    n_out = args.output_len
    ps = prompts(args.tpot_prompt_len, args.iters, vocab, args.seed + 1)
    fn(Item(ps[0], n_out))   # warmup of every decode context width
    firsts, fulls, outputs = [], [], []
    for p in ps:
        firsts.append(timed(fn, Item(p, 1))[0])
        t, out = timed(fn, Item(p, n_out))
        fulls.append(t)
        outputs.append(out)
    bar.update(1)
    bar.close()
    tpots = [(f - s) / (n_out - 1) for f, s in zip(fulls, firsts)]
    res.update(tpot_ms=1e3 * statistics.median(tpots), tpot_all_ms=[1e3 * t for t in tpots],
               e2e_ms=1e3 * statistics.median(fulls), outputs=outputs)
    return res


def add_roofline(res: dict[str, Any], stats: ModelStats, dtype: str, args: argparse.Namespace,
                 peak: dict[str, Any] | None) -> None:
    if not peak:
        return
    context = args.tpot_prompt_len + args.output_len / 2   # mean KV length while decoding
    ideal_tpot = stats.decode_bytes(dtype, context) / (peak["copy_gb_per_s"] * 1e9)
    res["tpot_roofline_ms"] = 1e3 * ideal_tpot
    res["tpot_pct_of_roofline"] = 100 * 1e3 * ideal_tpot / res["tpot_ms"]
    flops = stats.matmul_flops_per_token()
    res["ttft_pct_of_compute_roofline"] = {
        n: 100 * flops * n / (peak["matmul_tflops"] * 1e12) / (ms / 1e3)
        for n, ms in res["ttft_ms"].items()}


def jaxserve_fn(path: str, dtype: str, lens: list[int], args: argparse.Namespace,
                max_model_len: int) -> Generate:
    llm, _ = make_llm(path, dtype=dtype, max_num_seqs=1, max_model_len=max_model_len,
                      max_num_batched_tokens=max(lens + [args.tpot_prompt_len]),
                      enable_prefix_caching=False, seed=args.seed)
    return lambda item: js_generate(llm, [item], progress=False)[0]


def reference_fn(model: Any, pad_id: int, cache: str) -> Generate:
    def run(item: Item) -> list[int]:
        out = reference.generate_batch(model, [item], pad_id, cache)[0]
        reference.sync()
        return out
    return run


def reference_side(args: argparse.Namespace, path: str, dtype: str, device: str,
                   lens: list[int], vocab: int, pad_id: int) -> dict[str, Any]:
    threads = reference.set_threads(args.ref_threads)
    model = reference.load_model(path, dtype, device)
    probe, cache = None, args.ref_cache
    if cache == "auto":   # probed on the TPOT prompt, at batch 1
        item = Item(prompts(args.tpot_prompt_len, 1, vocab, args.seed + 2)[0], args.output_len)
        probe = reference.probe_cache(model, [item], pad_id)
        cache = probe["chosen"]
    res = measure(reference_fn(model, pad_id, cache), lens, args, vocab, "reference")
    del model
    reference.free_gpu_memory()
    return {**res, "cache": cache, "cache_probe": probe, "device": device,
            "torch_threads": threads}


def describe(args: argparse.Namespace, model_info: dict[str, Any], dtype: str, params: int,
             agreement: dict[str, Any] | None, peak: dict[str, Any] | None,
             skipped: list[int], max_pos: int) -> list[str]:
    notes = [(f"model: {model_info['model']} ({model_info['weights']}), {dtype}, "
              f"{params / 1e6:.1f} M parameters"),
             ("ratio = reference time / jaxserve time (higher: jaxserve faster); medians of "
              f"{args.iters}")]
    if agreement:
        notes.append(agree.summary(agreement))
    if peak:
        notes.append(f"roofline from {peak['file']} ({peak['device']}): copy "
                     f"{peak['copy_gb_per_s']:.1f} GB/s (read + write), matmul "
                     f"{peak['matmul_tflops']:.3f} TFLOP/s; TPOT's % is (weight + KV bytes) / "
                     "copy bandwidth over TPOT, TTFT's is weight FLOPs / matmul peak over TTFT")
    if skipped:
        notes.append(f"prompt lengths skipped (longer than the model's {max_pos} positions): "
                     f"{skipped}")
    return notes


def table(res: dict[str, Any], lens: list[int], args: argparse.Namespace) -> str:
    js, ref = res["jaxserve"], res.get("reference")

    def row(label: str, a: float, b: float | None, pct: float | None) -> list[Any]:
        return [label, f"{a:.2f}", "n/a" if b is None else f"{b:.2f}",
                "n/a" if b is None else f"{b / a:.2f}x", "n/a" if pct is None else f"{pct:.1f} %"]
    rows = [row(f"TTFT, prompt {n} (ms)", js["ttft_ms"][n], ref and ref["ttft_ms"][n],
                js.get("ttft_pct_of_compute_roofline", {}).get(n)) for n in lens]
    tpot = row(f"TPOT, prompt {args.tpot_prompt_len} + {args.output_len} out (ms)",
               js["tpot_ms"], ref and ref["tpot_ms"], js.get("tpot_pct_of_roofline"))
    rows.append(tpot)
    return markdown_table(["metric", "jaxserve", "transformers", "ratio (ref / jaxserve)",
                           "jaxserve % of roofline"], rows)


def plot(res: dict[str, Any], lens: list[int], path: str) -> None:
    from matplotlib.ticker import NullLocator
    plt, fig, (ax1, ax2) = new_figure(2)
    names = [n for n in ("jaxserve", "reference") if n in res]
    labels = {"jaxserve": "jaxserve", "reference": "transformers"}
    for name in names:
        ax1.plot(lens, [res[name]["ttft_ms"][n] for n in lens], "o-", label=labels[name])
    ax1.set(title="batch-1 TTFT", xlabel="prompt tokens", ylabel="ms", xscale="log",
            yscale="log")
    ax1.set_xticks(lens, [str(n) for n in lens])
    ax1.xaxis.set_minor_locator(NullLocator())   # the ticks are the prompt lengths
    ax1.legend()
    vals = [res[n]["tpot_ms"] for n in names]
    bars = ax2.bar([labels[n] for n in names], vals, color=["tab:blue", "tab:gray"][:len(names)])
    ax2.bar_label(bars, fmt="%.2f")
    if "tpot_roofline_ms" in res["jaxserve"]:
        ax2.axhline(res["jaxserve"]["tpot_roofline_ms"], color="tab:red", ls="--",
                    label="memory roofline")
        ax2.legend()
    ax2.set(title="batch-1 TPOT", ylabel="ms")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.output_len < 2:
        raise ValueError("--output-len must be >= 2 (TPOT needs a second token)")
    device = reference.torch_device(args.ref_device)
    dtype = checkpoint.default_dtype(args.dtype, device)
    path, model_info = checkpoint.prepare(args.model, args.load_format, dtype,
                                          args.weights_dir or os.path.join(args.output_dir,
                                                                           "weights"), args.seed)
    cfg = checkpoint.read_config(path)
    max_pos, vocab = cfg.get("max_position_embeddings", 1 << 30), cfg["vocab_size"]
    asked = [int(n) for n in args.prompt_lens.split(",")]
    lens = [n for n in asked if n + 1 <= max_pos]
    skipped = [n for n in asked if n not in lens]
    need = max(lens + [args.tpot_prompt_len + args.output_len])
    if not lens or args.tpot_prompt_len + args.output_len > max_pos:
        raise ValueError(f"the prompt lengths do not fit the model's {max_pos} positions")
    max_model_len = min(max_pos, -(-(need + 1) // 16) * 16)

    res: dict[str, Any] = {}
    if not args.skip_reference:   # first: on a GPU it must run before jax takes memory
        res["reference"] = reference_side(args, path, dtype, device, lens, vocab,
                                          cfg.get("pad_token_id") or 0)
    res["jaxserve"] = measure(jaxserve_fn(path, dtype, lens, args, max_model_len), lens, args,
                              vocab, "jaxserve")
    stats, peak = model_stats(path), load_roofline(args.roofline)
    for side in res.values():
        add_roofline(side, stats, dtype, args, peak)
    agreement = ratio = None
    if "reference" in res:
        agreement = agree.compare_outputs(res["jaxserve"]["outputs"],
                                          res["reference"]["outputs"])
        ratio = res["reference"]["tpot_ms"] / res["jaxserve"]["tpot_ms"]
        res["ttft_ratios"] = {n: res["reference"]["ttft_ms"][n] / res["jaxserve"]["ttft_ms"][n]
                              for n in lens}
    res["model"] = {"params": stats.params, "weight_bytes": stats.weight_bytes(dtype),
                    "kv_bytes_per_token": stats.kv_bytes_per_token(dtype)}
    notes = describe(args, model_info, dtype, stats.params, agreement, peak, skipped, max_pos)
    write_results(args.output_dir, args.name, benchmark="latency", argv=argv or [],
                  config={**vars(args), "dtype": dtype, "prompt_lens_run": lens,
                          "max_model_len": max_model_len, "model_info": model_info,
                          "roofline_used": peak},
                  results=res, table=table(res, lens, args), plot=lambda p: plot(res, lens, p),
                  ratio=ratio, agreement=agreement, notes=notes)
    return {"results": res, "ratio": ratio, "agreement": agreement}


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
