"""The prefix cache's host tier on a multi-turn trace (CPU): prefix hit rate and mean /
p90 TTFT with a small device pool alone, with the host tier, and with a device pool that
holds every conversation (the ceiling).

    python -m benchmarks.cache.tiered_cache_trace [--output-dir benchmarks/results] \\
        [--conversations 6 --turns 3] [--pool-pages 24] [--host-gib 0.25] [--model DIR]

Model: a random Llama (tests.checkpoints.make_tiny_checkpoint("llama") at hidden 256,
8 layers, float32), written once to $TMPDIR/jaxserve-bench-llama-tiered (or --model
DIR). Prompts are token ids, outputs greedy with eos ignored.

Trace (seeded by --seed): --conversations chats of --turns turns, taken round-robin one
request at a time (an agent's sessions coming back in turn): the first prompt is
--first-len random tokens, each later one the previous prompt + the reply (--reply-len
tokens) + a new user message (--user-len tokens). With --pool-pages device pages the
conversations need several times the pool, so by a conversation's next turn its pages
have been evicted; the host tier (--host-gib) keeps them.

Three engines in one process, the same settings but the caches: `device` (the small
pool, --num-gpu-blocks-override), `host` (the same pool and --kv-offloading-size),
`ceiling` (a pool of every conversation's pages). Each is warmed up at start-up
(compilation) and runs the trace once untimed and then --repeats times timed, its prefix
cache reset before each. TTFT: RequestOutput.metrics (first_token_time - arrival_time).
Hit rate: sum of num_cached_tokens / sum of prompt tokens. Greedy tokens of every engine
are compared with the device engine's. The goal (issue 44): the host tier gets >= 80 %
of the ceiling's mean-TTFT gain over the device pool alone.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from typing import Any

from benchmarks.shared.results_io import cpu_snapshot, markdown_table, other_load, write_results

MODEL_DIR = os.path.join(tempfile.gettempdir(), "jaxserve-bench-llama-tiered")
MODEL_CONFIG = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    max_position_embeddings=4096)
PS = 16


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", default="benchmarks/results")
    p.add_argument("--model", default=None, help="checkpoint dir (default: written once)")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--first-len", type=int, default=200)
    p.add_argument("--reply-len", type=int, default=16)
    p.add_argument("--user-len", type=int, default=48)
    p.add_argument("--pool-pages", type=int, default=24)
    p.add_argument("--host-gib", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    if not os.path.exists(os.path.join(MODEL_DIR, "config.json")):
        from tests.checkpoints import make_tiny_checkpoint   # torch: only to write it
        make_tiny_checkpoint("llama", MODEL_DIR, **MODEL_CONFIG)
    return MODEL_DIR


def max_len(args: argparse.Namespace) -> int:
    return args.first_len + (args.turns - 1) * (args.reply_len + args.user_len) + \
        args.reply_len


def engines(path: str, args: argparse.Namespace) -> dict[str, Any]:
    from jaxserve import LLM
    length = max_len(args)
    every = args.conversations * -(-length // PS) + 2
    common = dict(dtype="float32", max_model_len=-(-length // PS) * PS, max_num_seqs=4,
                  max_num_batched_tokens=512, page_size=PS)
    return {"device": LLM(path, num_gpu_blocks_override=args.pool_pages, **common),
            "host": LLM(path, num_gpu_blocks_override=args.pool_pages,
                        kv_offloading_size=args.host_gib, **common),
            "ceiling": LLM(path, num_gpu_blocks_override=every, **common)}


def run_trace(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    from jaxserve import SamplingParams
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.reply_len, ignore_eos=True)
    history = [[rng.randrange(3, 256) for _ in range(args.first_len)]
               for _ in range(args.conversations)]
    ttft, given, cached, tokens = [], 0, 0, []
    for _ in range(args.turns):
        for i in range(args.conversations):
            out = llm.generate({"prompt_token_ids": history[i]}, params, use_tqdm=False)[0]
            ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
            given += len(history[i])
            cached += out.num_cached_tokens
            reply = list(out.outputs[0].token_ids)
            tokens.append(reply)
            history[i] = history[i] + reply + [rng.randrange(3, 256)
                                               for _ in range(args.user_len)]
    ttft.sort()
    return {"ttft_mean_ms": 1e3 * statistics.fmean(ttft),
            "ttft_p90_ms": 1e3 * ttft[int(0.9 * (len(ttft) - 1))],
            "hit_rate": cached / given, "prompt_tokens": given, "cached_tokens": cached,
            "tokens": tokens}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = cpu_snapshot()
    llms = engines(model_dir(args), args)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in llms}
    for name, llm in llms.items():   # untimed: the trace's programs and host copies
        run_trace(llm, args)
    for _ in range(args.repeats):
        for name, llm in llms.items():
            llm.reset_prefix_cache()
            runs[name].append(run_trace(llm, args))
    ref = runs["device"][0]["tokens"]
    results: dict[str, Any] = {}
    for name, rs in runs.items():
        host = llms[name].engine.stats().host
        results[name] = {
            "ttft_mean_ms": statistics.median(r["ttft_mean_ms"] for r in rs),
            "ttft_p90_ms": statistics.median(r["ttft_p90_ms"] for r in rs),
            "hit_rate": rs[-1]["hit_rate"], "prompt_tokens": rs[-1]["prompt_tokens"],
            "cached_tokens": rs[-1]["cached_tokens"],
            "identical": sum(a == b for r in rs for a, b in zip(r["tokens"], ref)),
            "requests": sum(len(r["tokens"]) for r in rs),
            "host_hits": host.hits if host else None,
            "host_bytes_restored": host.bytes_restored if host else None}
    gain = results["device"]["ttft_mean_ms"] - results["ceiling"]["ttft_mean_ms"]
    got = results["device"]["ttft_mean_ms"] - results["host"]["ttft_mean_ms"]
    share = got / gain if gain > 0 else None
    table = markdown_table(
        ["caches", "hit rate", "TTFT mean ms", "TTFT p90 ms", "greedy identical"],
        [[name, f"{r['hit_rate'] * 100:.1f} %", r["ttft_mean_ms"], r["ttft_p90_ms"],
          f"{r['identical']}/{r['requests']}"] for name, r in results.items()])
    table += (f"\n\nShare of the ceiling's mean-TTFT gain the host tier gets: "
              f"{'n/a' if share is None else f'{share * 100:.0f} %'} (goal: >= 80 %)\n")
    print(table)
    load = other_load(start)
    write_results(args.output_dir, "tiered_cache_trace", benchmark="tiered_cache_trace",
                  argv=sys.argv if argv is None else argv,
                  config={k: v for k, v in vars(args).items()},
                  results={"engines": results, "gain_share": share, "other_load": load},
                  table=table, ratio=share)
    return results


if __name__ == "__main__":
    main()
