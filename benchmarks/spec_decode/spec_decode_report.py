"""spec_decode's report: the markdown tables and the notes of its results file."""
from __future__ import annotations

import argparse
from typing import Any

from benchmarks.shared.results_io import markdown_table
from benchmarks.spec_decode.spec_decode_runs import ENGINES, PHASES, STEP_KINDS


def f2(x: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def tables(res: dict[str, Any]) -> str:
    rows, ratio_rows, host_rows, kind_rows = [], [], [], []
    for w in res["workloads"]:
        for k in ENGINES:
            r = w["runs"][k]
            rows.append([w["workload"], "ngram" if k == "spec" else "off", r["out_tok_s"],
                         r["tpot_mean_ms"], r["tpot_median_ms"], r["ttft_mean_ms"],
                         r["steps"], f"{r['out_tokens_per_step']:.2f}",
                         "-" if k == "base" else f2(r["acceptance_rate"], "{:.1%}"),
                         "-" if k == "base" else f2(r["mean_acceptance_length"]),
                         "-" if k == "base" or not r["acceptance_per_pos"] else
                         " / ".join(f"{x:.2f}" for x in r["acceptance_per_pos"])])
            host, kinds = r["host_ms_per_step"], r["step_kinds"]
            host_rows.append([w["workload"], "ngram" if k == "spec" else "off",
                              *(f2(host.get(p), "{:.3f}") for p, _, _ in PHASES),
                              1e3 * r["wall_s"] / r["steps"]])
            kind_rows.append([w["workload"], "ngram" if k == "spec" else "off",
                              *(f"{kinds[x]['steps']} × {kinds[x]['median_ms']:.1f} = "
                                f"{kinds[x]['total_ms'] / 1e3:.2f} s" if x in kinds else "-"
                                for x in STEP_KINDS)])
        a, sim = w["agreement"], w["simulated"]
        each = w["throughput_ratio_paired_each"]
        ratio_rows.append([w["workload"], f"{w['throughput_ratio']:.2f}x",
                           f"{w['throughput_ratio_paired']:.2f}x ({min(each):.2f}–"
                           f"{max(each):.2f})", f"{w['cpu_time_ratio']:.2f}x",
                           f2(w["tpot_mean_speedup"], "{:.2f}x"),
                           f2(w["tpot_median_speedup"], "{:.2f}x"),
                           f"{w['steps_ratio']:.2f}",
                           f"{w['distinct_output_tokens_mean']:.1f} / {w['max_tokens']}",
                           f"{sim['prompt_accepted']} / {sim['accepted']}",
                           f"{a['identical_requests']}/{a['requests']}"
                           + ("" if a["all_runs_identical"] else " (some runs differ)")])
    main = markdown_table(
        ["workload", "spec", "out tok/s", "TPOT mean ms", "TPOT median ms", "TTFT mean ms",
         "steps", "out tok / step", "acceptance", "mean acc. length", "acc. per position"],
        rows)
    ratios = markdown_table(
        ["workload", "out tok/s, ngram / off", "same, paired (min–max)",
         "process CPU time, off / ngram", "TPOT mean, off / ngram",
         "TPOT median, off / ngram", "steps, ngram / off", "distinct tokens / output",
         "accepted drafts found in the prompt", "identical outputs"], ratio_rows)
    host = markdown_table(["workload", "spec", *(f"{p} ms" for p, _, _ in PHASES),
                           "wall ms / step"], host_rows)
    kinds = markdown_table(["workload", "spec", *(f"{x} steps × median ms = total"
                                                  for x in STEP_KINDS)], kind_rows)
    return "\n\n".join([main, ratios, "Host time per engine step, by phase (collect holds "
                        "the wait for the device and propose):", host,
                        "Steps by kind (prefill: holds a prompt chunk; decode: one token per "
                        "row; verify: some row verifies drafts; recompute: a hybrid's rows "
                        "computing again the tokens of a step whose drafts were rejected):",
                        kinds])


def notes(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    m = res["model"]
    out = [f"model: random {m['kind']} ({m['num_params'] / 1e6:.1f} M parameters, float32, "
           f"vocab {m['vocab_size']}); max_num_seqs {args.max_num_seqs}, "
           f"max_num_batched_tokens {args.max_num_batched_tokens}, max_model_len "
           f"{args.max_model_len}, page {args.page_size}; speculation: "
           f"{res['speculative_config']}",
           f"timings: the median over {args.repeats} runs of each engine (they alternate "
           "which runs first); paired: the median (and range) over repeats of one repeat's "
           "ngram / off ratio; process CPU time: user + system seconds of this process "
           "(less sensitive to other processes than wall time); TPOT per request "
           "(e2e - TTFT) / (output tokens - 1); "
           "acceptance = accepted / draft tokens; mean acceptance length = 1 + accepted / "
           "drafts; per position: the share of drafting rows that accepted position j",
           "a random model does not copy its prompt; where its greedy output loops on a few "
           "tokens of its own (few distinct tokens per output) the lookup predicts the loop "
           "('accepted drafts found in the prompt' counts the accepted drafts whose match "
           "was in the prompt, from the replay of the lookup over the final tokens)"]
    for w in res["workloads"]:
        s = w["simulated"]
        if not s["matches_engine"]:
            out.append(f"WARNING: {w['workload']}: the replayed lookup ({s['drafts']} drafts, "
                       f"{s['accepted']} accepted) differs from the engine's counters")
    bad = [w["workload"] for w in res["workloads"] if w["sampling"] == "greedy"
           and not (w["agreement"]["identical"] and w["agreement"]["all_runs_identical"])]
    out.append("greedy outputs of every run of both engines: " + (
        "identical token for token" if not bad else f"DIFFER in {', '.join(bad)}"))
    for w in res["workloads"]:
        if w["sampling"] != "greedy":
            a = w["agreement"]
            out.append(f"{w['workload']} (seeded sampling): {a['identical_requests']}/"
                       f"{a['requests']} requests identical with and without speculation")
    loads = [w["runs"][k]["other_processes_cores"] for w in res["workloads"] for k in ENGINES]
    out.append(f"most other-process load during a run: {max(loads, default=0):.2f} cores")
    return out

