"""Prefix caching on a Qwen3.5 hybrid: state snapshots at page boundaries vs no cache,
and vLLM's block-aligned rule simulated on the same trace.

    python -m benchmarks.cache.hybrid_prefix_cache [--output-dir benchmarks/results] \\
        [--conversations 4 --turns 6] [--system-len 1000 --questions 16 --burst 4] \\
        [--repeats 3] [--model DIR] [--no-27b]

Model: a random Qwen3.5 (tests.checkpoints.make_tiny_checkpoint("qwen3_5"), larger:
hidden 256, 8 layers = (3 Gated DeltaNet + 1 full attention) x 2, float32), written once
to $TMPDIR/jaxserve-bench-qwen35-hybrid (or --model DIR). Prompts are token ids (no
tokenizer), outputs greedy with eos ignored.

Workloads (all seeded by --seed):
- chat: --conversations conversations of --turns turns; the first prompt is random
  (--first-len tokens), each later one = the previous prompt + the model's reply
  (--chat-output tokens) + a new user message (--user-len lo,hi tokens). Each round
  sends turn t of every conversation at once (one generate() call).
- system: one --system-len token system prompt + a short distinct question each
  (--question-len lo,hi tokens, --answer-len output tokens); --questions requests
  one after another (one generate() call each).
- system-burst: the same with --burst requests at once (new questions, cache reset).

Both engines (enable_prefix_caching True and False, otherwise the same settings) live
in one process; each is warmed up (compilation at start-up, then a short untimed
shared-prefix trace that also takes and restores snapshots) and its prefix cache reset
before each run; each runs every workload --repeats times, the two taking turns to go
first, and the timings reported are the medians. The chat trace depends on the model's
replies: the first (uncached) run builds it and every later run replays the same
prompts, so all see the same token ids (every run's replies are compared with the
first's).

Reported per workload and engine: TTFT (RequestOutput.metrics: first_token_time -
arrival_time; for a round of requests sent together it includes the queue), prompt
tokens given vs computed (hit rate = sum num_cached_tokens / sum prompt tokens),
tokens/s (prompt + output over the workload's wall time), output tokens/s, snapshot
slots and restored tokens, greedy agreement.

The align rule (vLLM's `mamba_cache_mode="align"`, simulated in pure Python on the same
token sequences): the recurrent state is kept only at multiples of a block B, so a hit
is the longest cached prefix that is a multiple of B (and leaves a token to compute);
after each request (after each round of requests sent together) every B-multiple
prefix of its prompt + the output tokens whose KV was computed (all but the last) is
cached; the cache is unlimited, so this is the rule's best case. vLLM sizes B so that
one attention layer's page holds one linear-attention layer's state: per layer,
ceil(state bytes / KV bytes per token) rounded up to a multiple of 16 (the page size
here). The same quotient over all layers (state per sequence / KV bytes per token of
every attention layer: the cache plan's bytes_per_state_slot / (bytes_per_page /
page_size)) is reported beside it, and both are also simulated at Qwen3.6-27B's sizes
(`python -m jaxserve.plan --model qwen3.6-27b --mesh 1x8 --hbm 96GiB --json`). The
same simulation with B = the page size is the page-granular best case (every page
boundary cached, unlimited), what jaxserve's snapshots approach.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.cache.hybrid_prefix_cache_align import align_blocks, plan_27b, simulate_align
from benchmarks.cache.hybrid_prefix_cache_report import notes, tables
from benchmarks.shared.results_io import cpu_snapshot, other_load, write_results

MODEL_DIR = os.path.join(tempfile.gettempdir(), "jaxserve-bench-qwen35-hybrid")
MROPE_64 = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2], "mrope_interleaved": True}
# On top of tests.checkpoints' qwen3_5 (8 layers, (3 DeltaNet + 1 attention) x 2).
MODEL_CONFIG = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=64,
                    linear_value_head_dim=64, max_position_embeddings=4096,
                    rope_parameters=MROPE_64)
TOKEN_LO, TOKEN_HI = 3, 256        # random prompt ids: past the tiny tokenizer's specials


def model_dir(path: str = MODEL_DIR, **overrides: Any) -> str:
    """The random Qwen3.5 of this benchmark, written once (reused when there)."""
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    from tests.checkpoints import make_tiny_checkpoint
    return make_tiny_checkpoint("qwen3_5", path, **{**MODEL_CONFIG, **overrides})


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


# ---- the runs ------------------------------------------------------------------------
def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """One generate() call -> per request: prompt, output ids, hit, TTFT."""
    from jaxserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    res = []
    for p, o in zip(prompts, outs):
        m = o.metrics
        res.append({"prompt": list(p), "output": list(o.outputs[0].token_ids),
                    "cached": o.num_cached_tokens or 0,
                    "ttft_s": m.first_token_time - m.arrival_time})
    return res


def warm_up(llm: Any, seed: int) -> None:
    """Untimed: a shared prefix three times over (a branch snapshot taken, then
    restored), a follow-up turn (the rolling one restored), then the cache reset."""
    rng = random.Random(seed)
    shared = tokens(rng, 100)
    for _ in range(3):
        first = generate(llm, [shared + tokens(rng, 7)], 20)[0]
    generate(llm, [first["prompt"] + first["output"] + tokens(rng, 5)], 4)
    generate(llm, [shared + tokens(rng, 9) for _ in range(3)], 4)
    llm.reset_prefix_cache()


def snapshot_counts(llm: Any) -> dict[str, int] | None:
    snaps = llm.engine.scheduler.kv.snapshots
    if snaps is None:
        return None
    return {"num_slots": snaps.num_slots, "num_cached": snaps.num_cached,
            "num_restored_tokens": snaps.num_restored_tokens}


def run_rounds(llm: Any, rounds: list[list[list[int]]] | None, max_tokens: int,
               next_round: Any = None) -> dict[str, Any]:
    """Runs the workload's rounds (each a list of prompts sent at once) on a reset prefix
    cache. With next_round(previous results, index) the rounds are built as they go
    (the chat's next turn needs this turn's replies). -> per-request records by round,
    wall time, compilations, snapshot counts."""
    llm.reset_prefix_cache()
    before, compiles = snapshot_counts(llm), llm.engine.num_compilations
    done: list[list[dict[str, Any]]] = []
    start, t0 = cpu_snapshot(), time.perf_counter()
    while (prompts := (next_round(done, len(done)) if rounds is None else
                       rounds[len(done)] if len(done) < len(rounds) else None)) is not None:
        done.append(generate(llm, prompts, max_tokens))
    wall = time.perf_counter() - t0
    after = snapshot_counts(llm)
    snaps = None if after is None else {
        "num_slots": after["num_slots"], "num_cached_at_end": after["num_cached"],
        "restored_tokens": after["num_restored_tokens"] - before["num_restored_tokens"]}
    return {"rounds": done, "wall_s": wall, "compilations": llm.engine.num_compilations
            - compiles, "snapshots": snaps, "other_processes_cores": other_load(start)}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """One run's figures."""
    reqs = [r for rnd in run["rounds"] for r in rnd]
    ttft = [r["ttft_s"] * 1e3 for r in reqs]
    given = sum(len(r["prompt"]) for r in reqs)
    cached = sum(r["cached"] for r in reqs)
    out = sum(len(r["output"]) for r in reqs)
    return {"requests": len(reqs), "prompt_tokens": given, "cached_tokens": cached,
            "computed_prompt_tokens": given - cached, "hit_rate": cached / given,
            "output_tokens": out, "wall_s": run["wall_s"],
            "tok_s": (given + out) / run["wall_s"], "out_tok_s": out / run["wall_s"],
            "ttft_mean_ms": statistics.fmean(ttft), "ttft_median_ms": statistics.median(ttft),
            "ttft_ms_each": ttft, "cached_each": [r["cached"] for r in reqs],
            "compilations": run["compilations"], "snapshots": run["snapshots"],
            "other_processes_cores": run["other_processes_cores"]}


TIMES = ("wall_s", "tok_s", "out_tok_s", "ttft_mean_ms", "ttft_median_ms")


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine's repeats of one workload: the medians of the timings over repeats
    (each repeat's own figures kept under `repeats`); token counts, hits and snapshot
    counts are those of the first (the same in every repeat, checked)."""
    first = runs[0]
    for r in runs[1:]:
        assert r["cached_each"] == first["cached_each"], "hits differ between repeats"
    return {**{k: v for k, v in first.items() if k not in TIMES and k != "ttft_ms_each"},
            **{k: statistics.median(r[k] for r in runs) for k in TIMES},
            "compilations": sum(r["compilations"] for r in runs),
            "other_processes_cores": max((r["other_processes_cores"] or 0 for r in runs)),
            "repeats": [{k: r[k] for k in (*TIMES, "ttft_ms_each", "other_processes_cores")}
                        for r in runs]}


def agreement(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Greedy outputs of the two runs, request by request (same order)."""
    xs = [r["output"] for rnd in a["rounds"] for r in rnd]
    ys = [r["output"] for rnd in b["rounds"] for r in rnd]
    same = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            for x, y in zip(xs, ys)]
    bad = [i for i, (x, y) in enumerate(zip(xs, ys)) if x != y]
    return {"requests": len(xs), "identical_requests": len(xs) - len(bad),
            "identical": not bad and len(xs) == len(ys),
            "tokens_before_divergence": sum(same), "tokens": sum(map(len, xs)),
            "first_mismatch": None if not bad else {"request": bad[0],
                                                   "position": same[bad[0]]}}


def plan_dict(llm: Any) -> dict[str, Any]:
    p = llm.engine.info.cache_plan
    return {"page_size": p.page_size, "num_pages": p.num_pages,
            "num_state_slots": p.num_state_slots, "num_snapshot_slots": p.num_snapshot_slots,
            "bytes_per_page": p.bytes_per_page, "bytes_per_state_slot": p.bytes_per_state_slot,
            "num_kv_layers": p.num_kv_layers, "num_state_layers": p.num_state_layers,
            "snapshot_bytes": p.snapshot_bytes, "state_bytes": p.state_bytes,
            "kv_bytes": p.kv_bytes}


# ---- the workloads ---------------------------------------------------------------------
def chat_builder(args: argparse.Namespace):
    """next_round(done, t) for the chat: turn t of every conversation."""
    rng = random.Random(args.seed)
    lo, hi = span(args.user_len)
    firsts = [tokens(rng, args.first_len) for _ in range(args.conversations)]
    users = [[tokens(rng, rng.randint(lo, hi)) for _ in range(args.conversations)]
             for _ in range(args.turns)]

    def next_round(done: list[list[dict[str, Any]]], t: int) -> list[list[int]] | None:
        if t >= args.turns:
            return None
        if t == 0:
            return firsts
        return [r["prompt"] + r["output"] + users[t][c] for c, r in enumerate(done[t - 1])]
    return next_round


def system_rounds(args: argparse.Namespace, burst: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    system = tokens(random.Random(args.seed + 1), args.system_len)
    lo, hi = span(args.question_len)
    prompts = [system + tokens(rng, rng.randint(lo, hi)) for _ in range(args.questions)]
    return [prompts[i:i + burst] for i in range(0, len(prompts), burst)]


def run_workload(name: str, engines: dict[str, Any], max_tokens: int,
                 rounds: list[list[list[int]]] | None, builder: Any, repeats: int,
                 page_size: int, blocks: dict[str, int]) -> dict[str, Any]:
    """`repeats` runs of each engine on a reset cache, alternating which goes first;
    the first run is the uncached one (for the chat it builds the trace, which every
    later run replays)."""
    first = run_rounds(engines["uncached"], rounds, max_tokens, builder)
    trace = [[r["prompt"] for r in rnd] for rnd in first["rounds"]]
    runs: dict[str, list[dict[str, Any]]] = {"uncached": [first], "cached": []}
    for rep in range(repeats):
        order = ("cached", "uncached") if rep % 2 else ("uncached", "cached")
        for k in order:
            if len(runs[k]) <= rep:
                runs[k].append(run_rounds(engines[k], trace, max_tokens))
                assert [[r["prompt"] for r in rnd] for rnd in runs[k][-1]["rounds"]] == trace
        print(f"{name} repeat {rep + 1}/{repeats}: " + ", ".join(
            f"{k} {runs[k][rep]['wall_s']:.2f} s" for k in ("uncached", "cached")),
            file=sys.stderr, flush=True)
    res = {k: pooled([summarize(r) for r in v]) for k, v in runs.items()}
    # Greedy outputs: every run against the first (uncached) one.
    agree = agreement(runs["cached"][0], first)
    agree["all_runs_identical"] = all(agreement(r, first)["identical"]
                                      for v in runs.values() for r in v)
    pairs = [[(r["prompt"], r["output"]) for r in rnd] for rnd in runs["cached"][0]["rounds"]]
    align = {k: simulate_align(pairs, b) for k, b in blocks.items()}
    align["page"] = simulate_align(pairs, page_size)
    c, u = res["cached"], res["uncached"]
    paired = [uu["ttft_mean_ms"] / cc["ttft_mean_ms"]
              for uu, cc in zip(u["repeats"], c["repeats"])]
    return {"workload": name, "rounds": len(trace), "requests": c["requests"],
            "prompt_lens": [len(p) for rnd in trace for p in rnd], "runs": res,
            "agreement": agree, "align": align,
            "ttft_mean_speedup": u["ttft_mean_ms"] / c["ttft_mean_ms"],
            "ttft_mean_speedup_paired": statistics.median(paired),
            "ttft_median_speedup": u["ttft_median_ms"] / c["ttft_median_ms"],
            "throughput_ratio": c["tok_s"] / u["tok_s"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-dir", default="benchmarks/results")
    ap.add_argument("--name", default="hybrid_prefix_cache")
    ap.add_argument("--model", default=None, help=f"checkpoint dir (default: {MODEL_DIR}, "
                    "written on first use)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--first-len", type=int, default=300)
    ap.add_argument("--user-len", default="32,96", help="lo,hi tokens of a user message")
    ap.add_argument("--chat-output", type=int, default=48)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--question-len", default="12,40")
    ap.add_argument("--answer-len", type=int, default=32)
    ap.add_argument("--burst", type=int, default=4, help="requests at once in system-burst")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each engine per workload")
    ap.add_argument("--no-27b", action="store_true", help="skip the Qwen3.6-27B figures")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    need = max(args.first_len + args.turns * (args.chat_output + span(args.user_len)[1]),
               args.system_len + span(args.question_len)[1] + args.answer_len)
    if need > args.max_model_len:
        ap.error(f"--max-model-len {args.max_model_len} is below the longest request ({need})")

    from jaxserve import LLM
    path = args.model or model_dir()
    kw = dict(dtype="float32", max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, page_size=args.page_size,
              max_num_batched_tokens=args.max_num_batched_tokens)
    engines, startup = {}, {}
    for k, caching in (("cached", True), ("uncached", False)):
        t0 = time.perf_counter()
        engines[k] = LLM(path, enable_prefix_caching=caching, **kw)
        warm_up(engines[k], args.seed + 99)
        startup[k] = time.perf_counter() - t0
    plans = {k: plan_dict(e) for k, e in engines.items()}
    if plans["cached"]["num_snapshot_slots"] == 0:
        raise SystemExit("the cached engine has no snapshot slots: is the model a hybrid?")
    blocks = align_blocks(plans["cached"], args.page_size)
    g27 = None if args.no_27b else plan_27b()
    sim = {"this_per_layer": blocks["block_per_layer"],
           "this_all_layers": blocks["block_all_layers"]}
    if g27:
        sim |= {"q27b_per_layer": g27["block_per_layer"],
                "q27b_all_layers": g27["block_all_layers"]}

    workloads = [
        run_workload("chat", engines, args.chat_output, None, chat_builder(args),
                     args.repeats, args.page_size, sim),
        run_workload("system", engines, args.answer_len, system_rounds(args, 1, args.seed + 2),
                     None, args.repeats, args.page_size, sim),
        run_workload(f"system-burst{args.burst}", engines, args.answer_len,
                     system_rounds(args, args.burst, args.seed + 3), None, args.repeats,
                     args.page_size, sim)]
    import jax
    num_params = sum(x.size for x in jax.tree.leaves(engines["cached"].engine.params)) \
        if hasattr(engines["cached"].engine, "params") else None
    res = {"model": {"path": path, "config": MODEL_CONFIG if args.model is None else None,
                     "num_params": num_params or 0},
           "page_size": args.page_size, "cache_plan": plans, "align_blocks": blocks,
           "qwen3_6_27b": g27, "startup_s": startup, "workloads": workloads}
    table = tables(res)
    write_results(args.output_dir, args.name, benchmark="hybrid_prefix_cache", argv=argv,
                  config=vars(args), results=res, table=table, notes=notes(res, args),
                  agreement={w["workload"]: w["agreement"] for w in workloads})
    return res


if __name__ == "__main__":
    main()
