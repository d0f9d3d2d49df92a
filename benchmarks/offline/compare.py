"""Offline throughput: jaxserve vs the PyTorch reference, same weights file, same run.

    python -m benchmarks.offline.compare --model DIR|ALIAS [--load-format dummy] [--dtype bfloat16] \\
        [--workload random|decode-heavy|prefill-heavy|sharegpt-like|sharegpt:FILE] \\
        --num-prompts 64 --input-len 128 --output-len 128 [--range-ratio 0.5] \\
        [--batch-size 1] [--repeats 3] [--mesh 1x2 --cpu-devices 2] --output-dir DIR

The reference runs first (so on a GPU it can use the memory jaxserve will take),
then jaxserve; the greedy outputs of the two are compared token by token. Both
produce exactly each request's output length. Reported for both: requests/s,
output tok/s, total (prompt + output) tok/s, and the ratio jaxserve / reference.
`--batch-size 1` runs both one request at a time: the latency view. `--repeats N`
times each system N times (the reference at its chosen batch size and cache) and
reports the medians, for machines whose speed moves between runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from benchmarks.shared import agreement as agree
from benchmarks.shared import checkpoint, reference
from benchmarks.shared.jaxserve_offline import run_jaxserve, split_cpu
from benchmarks.shared.model_stats import model_stats
from benchmarks.shared.results_io import markdown_table, new_figure, write_results
from benchmarks.shared.roofline import load_roofline
from benchmarks.shared.workloads import Workload, make_workload

METRICS = ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--model", required=True, help="checkpoint directory, or an alias with --load-format dummy")
    a("--load-format", default="auto", choices=["auto", "dummy"],
      help="dummy: random weights, written once as safetensors and loaded by both")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
      help="auto: bfloat16 where torch sees a GPU, else float32")
    a("--workload", default="random")
    a("--num-prompts", type=int, default=64)
    a("--input-len", type=int, default=128, help="random workload")
    a("--output-len", type=int, default=128, help="random workload")
    a("--range-ratio", type=float, default=0.0, help="random workload: lengths L(1 +- r)")
    a("--seed", type=int, default=0)
    a("--batch-size", type=int, default=None,
      help="both systems at this batch (1: latency view); default: each its own best")
    a("--max-num-seqs", type=int, default=None, help="jaxserve; default min(256, prompts)")
    a("--max-num-batched-tokens", type=int, default=None, help="jaxserve; default its own")
    a("--mesh", default=None, help="jaxserve; DxM data x tensor parallel (engine's --mesh)")
    a("--repeats", type=int, default=1,
      help="time each system's run this many times and take the median (noisy machines)")
    a("--cpu-devices", type=int, default=None,
      help="split the CPU into N XLA devices for --mesh (e.g. 2 with --mesh 1x2)")
    a("--max-model-len", type=int, default=None,
      help="jaxserve; default the workload's longest prompt + output")
    a("--ref-batch-size", default="auto",
      help="auto: the largest power of two that fits; or sizes to try, e.g. 16,32,64")
    a("--ref-max-batch-size", type=int, default=256)
    a("--ref-cache", default="auto", choices=["auto", "dynamic", "static"],
      help="auto: a probe picks the faster")
    a("--ref-device", default="auto", choices=["auto", "cpu", "cuda"])
    a("--ref-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    a("--agree-tokens", type=int, default=16, help="K of the first-K-tokens agreement rate")
    a("--roofline", default=None, help="roofline.json of benchmarks.shared.roofline (adds MFU)")
    a("--weights-dir", default=None, help="where dummy weights go (default OUTPUT_DIR/weights)")
    a("--output-dir", required=True)
    a("--name", default=None, help="file name stem (default compare_<workload>[_bs1])")
    return p


def throughput(seconds: float, wl: Workload) -> dict[str, float]:
    s = wl.stats()
    return {"seconds": seconds, "requests_per_s": s["num_prompts"] / seconds,
            "output_tokens_per_s": s["output_tokens"] / seconds,
            "total_tokens_per_s": (s["prompt_tokens"] + s["output_tokens"]) / seconds,
            "seconds_per_request": seconds / s["num_prompts"]}


def mfu(result: dict[str, Any], flops_per_token: int, peak: dict[str, Any] | None
        ) -> float | None:
    """Model FLOP/s (weights only) over the measured matmul peak, or None without one."""
    if not peak or not peak.get("matmul_tflops"):
        return None
    return result["total_tokens_per_s"] * flops_per_token / (peak["matmul_tflops"] * 1e12)


def pick_max_model_len(args: argparse.Namespace, wl: Workload, max_pos: int) -> int:
    need = max(len(it.prompt_token_ids) + it.max_tokens for it in wl.items)
    chosen = args.max_model_len or min(max_pos, -(-need // 16) * 16)
    if need > chosen:
        raise ValueError(f"the workload needs {need} tokens per sequence, more than "
                         f"max_model_len {chosen} (model limit {max_pos})")
    return chosen


def load_workload(args: argparse.Namespace, path: str, cfg: dict[str, Any]) -> Workload:
    encode = None
    if args.workload.startswith("sharegpt:"):
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path)

        def encode(text: str) -> list[int]:
            return tok(text, add_special_tokens=False).input_ids
    return make_workload(args.workload, num_prompts=args.num_prompts, input_len=args.input_len,
                         output_len=args.output_len, range_ratio=args.range_ratio,
                         vocab_size=cfg["vocab_size"], seed=args.seed, encode=encode,
                         max_model_len=args.max_model_len or cfg.get("max_position_embeddings"))


def run_ref_side(args: argparse.Namespace, path: str, wl: Workload, dtype: str,
                 device: str, pad_id: int
                 ) -> tuple[reference.RefRun, list[dict[str, Any]], int]:
    threads = reference.set_threads(args.ref_threads)
    model = reference.load_model(path, dtype, device)
    if args.batch_size:
        sizes, first_fit = [args.batch_size], True
    else:
        sizes, first_fit = reference.candidate_sizes(args.ref_batch_size, len(wl.items),
                                                     args.ref_max_batch_size)
    run, tried = reference.run_reference(model, wl.items, sizes, first_fit, pad_id,
                                         args.ref_cache)
    run.seconds_each = [run.seconds] + [
        reference.run_static_batches(model, wl.items, run.batch_size, pad_id, run.cache).seconds
        for _ in range(args.repeats - 1)]
    run.seconds = statistics.median(run.seconds_each)
    del model
    reference.free_gpu_memory()
    return run, tried, threads


def table(res: dict[str, Any], ratios: dict[str, float], a: dict[str, Any]) -> str:
    rows = []
    for name in ("jaxserve", "reference"):
        r = res[name]
        rows.append([name, r["batch"], f"{r['seconds']:.2f}", f"{r['requests_per_s']:.2f}",
                     f"{r['output_tokens_per_s']:.1f}", f"{r['total_tokens_per_s']:.1f}",
                     "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f} %"])
    rows.append(["**ratio** (jaxserve / reference)", "", "",
                 *(f"**{ratios[k]:.2f}x**" for k in METRICS), ""])
    rows.append(["agreement", "", "", "", "", "",
                 f"{a['identical_requests']}/{a['num_requests']} identical"])
    return markdown_table(["system", "batch", "seconds", "req/s", "output tok/s",
                           "total tok/s", "MFU"], rows)


def describe(res: dict[str, Any], agreement: dict[str, Any], model_info: dict[str, Any],
             dtype: str, params: int, device: str, max_model_len: int) -> list[str]:
    """The notes under the table: what ran, and how the outputs compare."""
    w, ref, js = res["workload"], res["reference"], res["jaxserve"]
    notes = [
        agree.summary(agreement),
        (f"model: {model_info['model']} ({model_info['weights']}), {dtype}, "
         f"{params / 1e6:.1f} M parameters"),
        (f"workload {w['name']}: {w['num_prompts']} requests, prompts mean "
         f"{w['prompt_len_mean']:.0f} / max {w['prompt_len_max']} tokens, outputs mean "
         f"{w['output_len_mean']:.0f} / max {w['output_len_max']}"),
        (f"reference: transformers generate, batch {ref['batch']} sorted by prompt length, "
         f"{ref['cache']} cache, {device} ({ref['torch_threads']} threads); "
         f"{ref['padded_fraction']:.0%} of its decode rows are "
         "padding past a request's end"),
        (f"jaxserve: max_num_seqs {js['batch']}, max_model_len {max_model_len}; "
         f"{js['compiles_during_run']} compilations during the timed run"),
    ]
    if len(js["seconds_each"]) > 1:
        notes.append(f"times are the median of {len(js['seconds_each'])} runs of each system: "
                     f"jaxserve {seconds_list(js)} s, reference {seconds_list(ref)} s")
    if js["batch"] == ref["batch"] == 1:
        notes.append(f"batch 1, one request at a time: mean request latency jaxserve "
                     f"{js['seconds_per_request']:.3f} s, reference "
                     f"{ref['seconds_per_request']:.3f} s")
    return notes


def seconds_list(side: dict[str, Any]) -> str:
    return ", ".join(f"{s:.2f}" for s in side["seconds_each"])


def plot(res: dict[str, Any], ratio: float, title: str, path: str) -> None:
    plt, fig, axes = new_figure(3, width=4.0)
    for ax, (key, label) in zip(axes, (("requests_per_s", "requests/s"),
                                       ("output_tokens_per_s", "output tok/s"),
                                       ("total_tokens_per_s", "total tok/s"))):
        vals = [res["jaxserve"][key], res["reference"][key]]
        bars = ax.bar(["jaxserve", "transformers"], vals, color=["tab:blue", "tab:gray"])
        ax.bar_label(bars, fmt="%.1f")
        ax.set(title=label, ylabel=label)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{title}: jaxserve / transformers = {ratio:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    split_cpu(args.cpu_devices)
    device = reference.torch_device(args.ref_device)
    dtype = checkpoint.default_dtype(args.dtype, device)
    path, model_info = checkpoint.prepare(args.model, args.load_format, dtype,
                                          args.weights_dir or os.path.join(args.output_dir,
                                                                           "weights"),
                                          args.seed)
    cfg = checkpoint.read_config(path)
    wl = load_workload(args, path, cfg)
    max_model_len = pick_max_model_len(args, wl, cfg.get("max_position_embeddings", 1 << 30))
    pad_id = cfg.get("pad_token_id") or 0

    ref, tried, threads = run_ref_side(args, path, wl, dtype, device, pad_id)
    max_num_seqs = args.batch_size or args.max_num_seqs or min(256, len(wl.items))
    engine_args = dict(dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                       seed=args.seed)
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.mesh:
        engine_args["mesh"] = args.mesh
    js = run_jaxserve(path, wl.items, repeats=args.repeats, **engine_args)

    stats, peak = model_stats(path), load_roofline(args.roofline)
    res: dict[str, Any] = {
        "jaxserve": {**throughput(js.seconds, wl), "batch": max_num_seqs,
                     "seconds_each": js.seconds_each, "startup_s": js.startup_s,
                     "compiles_during_run": js.compiles_during_run,
                     "engine_args": js.engine_args},
        "reference": {**throughput(ref.seconds, wl), "batch": ref.batch_size,
                      "seconds_each": ref.seconds_each, "cache": ref.cache,
                      "cache_probe": ref.probe, "device": device,
                      "torch_threads": threads,
                      "padded_fraction": ref.padded_fraction, "batch_sizes_tried": tried},
        "workload": {"name": wl.name, **wl.params, **wl.stats()},
    }
    for name in ("jaxserve", "reference"):
        res[name]["mfu"] = mfu(res[name], stats.matmul_flops_per_token(), peak)
    ratios = {k: res["jaxserve"][k] / res["reference"][k] for k in METRICS}
    res["ratios"] = ratios
    agreement = agree.compare_outputs(js.outputs, ref.outputs, args.agree_tokens)
    name = args.name or f"compare_{wl.name.split(':')[0]}" + ("_bs1" if args.batch_size == 1
                                                              else "")
    notes = describe(res, agreement, model_info, dtype, stats.params, device, max_model_len)
    config = {**vars(args), "dtype": dtype, "ref_device": device, "model_info": model_info,
              "max_model_len": max_model_len, "roofline_used": peak}
    write_results(args.output_dir, name, benchmark="compare", argv=argv or [], config=config,
                  results=res, table=table(res, ratios, agreement),
                  plot=lambda p: plot(res, ratios["output_tokens_per_s"], name, p),
                  ratio=ratios["output_tokens_per_s"], agreement=agreement, notes=notes)
    return {"results": res, "ratio": ratios["output_tokens_per_s"], "agreement": agreement}


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
