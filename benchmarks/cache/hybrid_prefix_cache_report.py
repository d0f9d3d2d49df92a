"""hybrid_prefix_cache's report: the markdown tables and the notes of its results file."""
from __future__ import annotations

import argparse
from typing import Any

from benchmarks.shared.results_io import markdown_table


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def tables(res: dict[str, Any]) -> str:
    blocks = res["align_blocks"]
    rows = []
    for w in res["workloads"]:
        for k in ("uncached", "cached"):
            r = w["runs"][k]
            snaps = r["snapshots"]
            rows.append([w["workload"], k, r["requests"], f"{r['prompt_tokens']} / "
                         f"{r['computed_prompt_tokens']}", pct(r["hit_rate"]),
                         r["ttft_mean_ms"], r["ttft_median_ms"], r["tok_s"], r["out_tok_s"],
                         "-" if snaps is None else
                         f"{snaps['num_slots']} / {snaps['restored_tokens']}",
                         r["compilations"]])
    main = markdown_table(
        ["workload", "prefix cache", "requests", "prompt tokens given / computed",
         "hit rate", "TTFT mean ms", "TTFT median ms", "tok/s", "out tok/s",
         "snapshot slots / tokens restored", "compilations"], rows)
    g27 = res.get("qwen3_6_27b") or {}
    ratio_rows = [[w["workload"], f"{w['ttft_mean_speedup']:.2f}x",
                   f"{w['ttft_mean_speedup_paired']:.2f}x",
                   f"{w['ttft_median_speedup']:.2f}x", f"{w['throughput_ratio']:.2f}x",
                   f"{w['agreement']['identical_requests']}/{w['agreement']['requests']}"
                   + ("" if w["agreement"]["all_runs_identical"] else " (some runs differ)")]
                  for w in res["workloads"]]
    ratios = markdown_table(["workload", "TTFT mean, uncached / cached", "same, paired",
                             "TTFT median, uncached / cached", "tok/s, cached / uncached",
                             "identical greedy outputs"], ratio_rows)
    heads = ["workload", "jaxserve snapshots (measured)",
             f"page-granular best case (B = {res['page_size']})",
             f"align, B = {blocks['block_per_layer']} (vLLM: per layer)",
             f"align, B = {blocks['block_all_layers']} (all layers)"]
    keys = ["page", "this_per_layer", "this_all_layers"]
    if g27:
        heads += [f"align, B = {g27['block_per_layer']} (27B per layer)",
                  f"align, B = {g27['block_all_layers']} (27B all layers)"]
        keys += ["q27b_per_layer", "q27b_all_layers"]
    hit = markdown_table(heads, [[w["workload"], pct(w["runs"]["cached"]["hit_rate"]),
                                  *(pct(w["align"][k]["hit_rate"]) for k in keys)]
                                 for w in res["workloads"]])
    return "\n\n".join([main, ratios, "Hit rate (cached prompt tokens / prompt tokens) on "
                        "the same trace:", hit])


def notes(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    p, b = res["cache_plan"]["cached"], res["align_blocks"]
    out = [f"model: random Qwen3.5, {res['model']['num_params'] / 1e6:.1f} M parameters, "
           f"float32, {p['num_state_layers']} Gated DeltaNet + {p['num_kv_layers']} full "
           f"attention layers; page {p['page_size']} tokens; max_num_seqs "
           f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
           f"max_model_len {args.max_model_len}",
           f"state per sequence {p['bytes_per_state_slot'] / 2**10:.0f} KiB, KV "
           f"{b['kv_bytes_per_token'] / 2**10:.1f} KiB per token: a state is worth "
           f"{b['tokens_per_state_per_layer']:.1f} tokens of KV per layer (vLLM's block "
           f"{b['block_per_layer']}), {b['tokens_per_state_all_layers']:.1f} over all layers "
           f"(block {b['block_all_layers']}); the cached engine's plan has "
           f"{p['num_snapshot_slots']} snapshot slots ({p['snapshot_bytes'] / 2**20:.1f} MiB, "
           f"{p['num_snapshot_slots'] / args.max_num_seqs:g} per max_num_seqs), the uncached one "
           f"{res['cache_plan']['uncached']['num_snapshot_slots']}",
           f"timings: the median over {args.repeats} runs of each engine (the engines "
           "alternate which runs first; every run's figures are in the JSON); TTFT: "
           "RequestOutput.metrics first_token_time - arrival_time (a round's requests are "
           "sent together, so theirs include the queue); tok/s: prompt + output tokens over "
           "the workload's wall time (generate() calls back to back); paired: the median "
           "over repeats of uncached / cached mean TTFT; snapshots: the cache's slots and the "
           "tokens its hits restored",
           "align: vLLM's mamba_cache_mode='align' simulated on the cached run's token "
           "sequences with an unlimited cache, each request seeing every one sent before it "
           "(its best case); page-granular: the same with B = the page size"]
    g = res.get("qwen3_6_27b")
    if g:
        out.append(
            f"Qwen3.6-27B (`{g['command']}`): KV {g['kv_bytes_per_token_per_device'] / 2**10:.0f}"
            f" KiB per token per device ({g['num_kv_layers']} attention layers), state "
            f"{g['state_bytes_per_seq_per_device'] / 2**20:.2f} MiB per sequence per device "
            f"({g['state_layout']}): a state is worth {g['tokens_per_state_per_layer']:.0f} "
            f"tokens of KV per layer, so vLLM's align rule would keep states every "
            f"{g['block_per_layer']} tokens (over all layers: "
            f"{g['tokens_per_state_all_layers']:.0f} -> {g['block_all_layers']}); jaxserve "
            f"keeps them at 16-token page boundaries ({g['num_snapshot_slots']} snapshot "
            f"slots in that plan). jaxserve keeps the delta-rule state in float32; vLLM's "
            f"default (mamba_ssm_cache_dtype auto) follows the model's bfloat16, which "
            f"about halves the state and these blocks")
    bad = [w["workload"] for w in res["workloads"]
           if not (w["agreement"]["identical"] and w["agreement"]["all_runs_identical"])]
    out.append("greedy outputs of every run of both engines: " + (
        "identical token for token in every workload" if not bad else
        f"DIFFER in {', '.join(bad)} (see agreement in the JSON)"))
    loads = [w["runs"][k]["other_processes_cores"] for w in res["workloads"]
             for k in ("cached", "uncached")]
    loads = [x for x in loads if x is not None]
    out.append(f"most other-process load during a run: {max(loads, default=0):.2f} cores")
    return out
