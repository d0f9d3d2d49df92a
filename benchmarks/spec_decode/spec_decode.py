"""Speculative decoding, ngram (prompt lookup): an engine with it vs one without, on CPU.

    python -m benchmarks.spec_decode.spec_decode [--output-dir benchmarks/results] \\
        [--model-kind llama|qwen3_5] [--model DIR] [--num-spec 3] \\
        [--prompt-lookup-min 2 --prompt-lookup-max 5] [--repeats 7] \\
        [--code-requests 8 --code-lines 16 --code-output 256 --bs1-requests 4] \\
        [--random-requests 8 --random-input 256 --random-output 256] [--name NAME] \\
        [--workloads code-edit,code-edit-bs1,random,random-t1]

Model: a random-weight checkpoint written once by tests.checkpoints.make_tiny_checkpoint
(or --model DIR): --model-kind llama (default; hidden 256, 4 layers, vocab 4096, float32)
or qwen3_5 (the hybrid of benchmarks/cache/hybrid_prefix_cache.py: hidden 256, 6 Gated DeltaNet
+ 2 full-attention layers, vocab 4096), under $TMPDIR/jaxserve-bench-spec-<kind>. Its
tokenizer is the tests' tiny byte-level BPE (256 tokens): the code workload is text.

Workloads (seeded by --seed; eos ignored, so every request makes exactly its length):
- code-edit: --code-requests prompts, all sent at once. Each holds a seeded, procedurally
  written Python module (--code-lines statements in a few functions), an instruction
  to rewrite it with one identifier renamed, and the start of the answer ("```python\\n"
  and the module's first line with the new name); --code-output tokens, greedy.
- code-edit-bs1: the first --bs1-requests of those prompts, one at a time (batch 1,
  where speculation is meant to cut the time per token).
- random: --random-requests prompts of --random-input uniform random token ids
  (benchmarks/shared/workloads.py's random dataset), --random-output tokens, greedy.
- random-t1: the same prompts sampled at temperature 1 with a seed per request: the
  output is close to random text, so prompt lookup finds (almost) nothing to propose:
  the case where speculation can only cost.

A random model does not copy its prompt, so the drafts a lookup finds in the prompt are
rejected. The random llama's greedy output falls instead into short loops of its own
tokens after a few steps (a handful of distinct tokens per output), and the lookup then
predicts the loop from the model's own earlier output: its acceptance is the model's
repetitiveness, not a code-editing model's copying. The random Qwen3.5's greedy output
does not loop (most of its tokens are distinct), so there the lookup rarely finds a
draft and most are rejected: the low-acceptance case. Each run also replays the lookup
over the final tokens (`simulated`, exact: drafts depend only on the tokens so far)
and counts where each accepted draft was found, in the prompt or in the output.

Both engines (speculative_config None and {"method": "ngram", ...}; otherwise the same
settings) live in one process and are warmed up (compilation at start-up, then one
short untimed run of each kind of request); each workload runs --repeats times per
engine on a reset prefix cache, the two taking turns to go first; timings are medians.

Reported per workload and engine: output tokens/s (output tokens over wall time); TPOT
per request = (e2e - TTFT) / (output tokens - 1) from RequestOutput.metrics (mean and
median over requests); TTFT; engine steps and tokens computed on device; the scheduler's
speculative counters for the run: drafts (rows that verified drafts), draft tokens,
accepted tokens, acceptance rate (accepted / draft tokens), mean acceptance length
(1 + accepted / drafts), acceptance per position (accepted at j / drafts); the host's
time per step by phase (schedule, dispatch = input build + launch, collect = the wait
for the device + reading the tokens back (propose included), propose, scheduler update,
output processing), measured by wrapping those methods on the engine instances; each
step's time by its kind (prefill; decode: one token per row; verify: some row verifies
drafts; recompute: a hybrid's rows computing again the tokens of a step that rejected
drafts); the process's CPU time (user + system), which other processes on a shared
machine disturb less than wall time; and greedy agreement (every run of both engines
token for token the same).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.shared.results_io import cpu_snapshot, markdown_table, other_load, write_results

MODEL_DIR = os.path.join(tempfile.gettempdir(), "jaxserve-bench-spec-{kind}")
VOCAB = 4096
LLAMA_CONFIG = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    vocab_size=VOCAB, max_position_embeddings=2048)
KINDS = ("llama", "qwen3_5")
WORKLOADS = ("code-edit", "code-edit-bs1", "random", "random-t1")
ENGINES = ("base", "spec")    # without / with speculation


def model_config(kind: str) -> dict[str, Any]:
    if kind == "llama":
        return dict(LLAMA_CONFIG)
    from benchmarks.cache.hybrid_prefix_cache import MODEL_CONFIG
    return {**MODEL_CONFIG, "vocab_size": VOCAB}


def model_vocab(path: str) -> int:
    """The checkpoint's vocabulary size (a Qwen3.5 keeps it under text_config)."""
    import json
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    return cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]


def model_dir(kind: str, path: str | None = None) -> str:
    """The random checkpoint of this benchmark, written once (reused when there)."""
    path = path or MODEL_DIR.format(kind=kind)
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    from tests.checkpoints import make_tiny_checkpoint
    return make_tiny_checkpoint(kind, path, **model_config(kind))


# ---- the code-editing workload -------------------------------------------------------------
NAMES = ("items", "total", "price", "count", "value", "result", "index", "record", "buffer",
         "offset", "limit", "weight", "scale", "name", "path", "size", "width", "height",
         "cache", "key", "entry", "node", "parent", "child", "depth", "score", "rate")
FUNCS = ("compute", "update", "load", "parse", "merge", "filter", "render", "collect")
NOUNS = ("totals", "records", "config", "tree", "table", "scores", "rows", "batch")


def code_module(rng: random.Random, num_lines: int) -> tuple[str, str, str]:
    """A seeded Python module of about num_lines statements -> (code, an identifier it
    uses, the name to rename it to)."""
    lines, stmts = [], 0
    while stmts < num_lines:
        fn = f"{rng.choice(FUNCS)}_{rng.choice(NOUNS)}"
        args = rng.sample(NAMES, 2)
        lines.append(f"def {fn}({args[0]}, {args[1]}):")
        local = list(args)
        for _ in range(rng.randint(3, 6)):
            a, b = rng.sample(local, 2)
            new = rng.choice(NAMES)
            form = rng.randrange(4)
            if form == 0:
                lines.append(f"    {new} = {a} + {b} * {rng.randint(2, 9)}")
            elif form == 1:
                lines.append(f"    for {new} in {a}:")
                lines.append(f"        {b} += {new}")
                stmts += 1
            elif form == 2:
                lines.append(f"    if {a} > {b}:")
                lines.append(f"        {new} = {a} - {b}")
                stmts += 1
            else:
                lines.append(f"    {new} = {fn}({a}, {b} + 1)")
            local.append(new)
            stmts += 1
        lines.append(f"    return {rng.choice(local)}")
        lines.append("")
        stmts += 1
    code = "\n".join(lines)
    old = rng.choice(sorted({w for w in NAMES if w in code}))
    return code, old, f"{old}_{rng.choice(('new', 'v2', 'fixed'))}"


def code_prompts(tok: Any, n: int, num_lines: int, seed: int) -> list[list[int]]:
    """n code-editing prompts (token ids)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        code, old, new = code_module(rng, num_lines)
        first = code.split("\n", 1)[0].replace(old, new)
        text = (f"```python\n{code}```\n# Rewrite the code above with `{old}` renamed to "
                f"`{new}`; keep everything else the same.\n```python\n{first}\n")
        out.append(tok.encode(text, add_special_tokens=False))
    return out


# ---- the prompt lookup, replayed ------------------------------------------------------------
def match_ends(tokens: np.ndarray, drafts: list[int], n_min: int, n_max: int) -> list[int]:
    """Where a lookup that proposed `drafts` may have matched: the earlier ends of the
    longest suffix (n_max down to n_min tokens) that recurs followed by the drafts ([]
    when none). Which of them ngram_propose picks is its own rule; this needs only
    that it proposes what followed an occurrence of the longest recurring suffix."""
    n, last = len(tokens), len(tokens) - 1
    d = np.asarray(drafts, tokens.dtype)
    for m in range(min(n_max, last), n_min - 1, -1):
        suffix = tokens[n - m:]
        ends = np.flatnonzero(tokens[m - 1:last] == tokens[last]) + (m - 1)
        hits = [int(e) for e in ends if np.array_equal(tokens[e - m + 1:e + 1], suffix)]
        if hits:
            return [e for e in hits if np.array_equal(tokens[e + 1:e + 1 + len(d)], d)]
    return []


def simulate(prompt: list[int], output: list[int], n_min: int, n_max: int, k: int,
             max_tokens: int) -> dict[str, Any]:
    """The engine's drafts replayed over a request's final tokens: after the prefill's
    token, each step proposes from the tokens so far (ngram_propose, cut as the
    scheduler cuts them at max_tokens), accepts the drafts that equal the next tokens
    and appends one more. -> the counters, and how many drafts / accepted drafts came
    from a match in the prompt (every occurrence they could come from ends there).""" 
    from jaxserve.runner.spec_decode import ngram_propose
    toks = np.asarray(list(prompt) + list(output), np.int64)
    pos, p = len(prompt) + 1, len(prompt)
    res = dict(steps=1, drafts=0, draft_tokens=0, accepted=0, per_pos=[0] * k,
               prompt_drafts=0, prompt_accepted=0)
    while pos < len(toks):
        d = ngram_propose(toks[:pos], n_min, n_max, k)[:max(0, max_tokens - (pos - p) - 1)]
        a = 0
        while a < len(d) and pos + a < len(toks) and toks[pos + a] == d[a]:
            a += 1
        if d:
            res["drafts"] += 1
            res["draft_tokens"] += len(d)
            res["accepted"] += a
            for j in range(a):
                res["per_pos"][j] += 1
            ends = match_ends(toks[:pos], d, n_min, n_max)
            if ends and max(ends) < p:
                res["prompt_drafts"] += 1
                res["prompt_accepted"] += a
        pos += a + 1
        res["steps"] += 1
    return res


def add_sims(sims: list[dict[str, Any]]) -> dict[str, Any]:
    out = {k: sum(s[k] for s in sims) for k in sims[0] if k != "per_pos"}
    out["per_pos"] = [sum(x) for x in zip(*(s["per_pos"] for s in sims))]
    return out


# ---- the engines -------------------------------------------------------------------------
PHASES = (("schedule", "scheduler", "schedule"), ("dispatch", "runner", "dispatch"),
          ("collect", "runner", "collect"), ("propose", "runner", "_propose"),
          ("update", "scheduler", "update_from_output"), ("outputs", "outputs", "process"))


STEP_KINDS = ("prefill", "decode", "verify", "recompute")


def step_kind(core: Any, so: Any) -> str:
    """prefill: a step with a prompt chunk; decode: one token per row; verify: some row
    verifies drafts; recompute: more tokens than rows + drafts without a prompt chunk
    (a hybrid's rows computing again the tokens of a step whose drafts were rejected)."""
    try:
        c, reqs = so.cached_reqs, core.scheduler.requests
        if so.new_reqs or any(s < reqs[r].num_prompt_tokens
                              for r, s in zip(c.req_ids, c.num_computed_tokens)):
            return "prefill"
        drafts = sum(len(d) for d in so.spec_token_ids.values())
        if sum(c.num_new_tokens) > len(c.req_ids) + drafts:
            return "recompute"
        return "verify" if drafts else "decode"
    except (AttributeError, KeyError, TypeError):
        return "unknown"


def instrument(llm: Any) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Wraps the engine's step phases (instance attributes, the classes untouched) ->
    the running totals of their seconds by phase, and every step's (kind, seconds from
    begin_step's start to finish_step's end)."""
    core, totals, steps = llm.engine, defaultdict(float), []
    for phase, owner, name in PHASES:
        obj = getattr(core, owner, None)
        fn = getattr(obj, name, None)
        if fn is None:
            continue

        def timed(*a: Any, _fn: Callable = fn, _phase: str = phase, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                totals[_phase] += time.perf_counter() - t0
        setattr(obj, name, timed)
    begin, finish, started = core.begin_step, core.finish_step, {}

    def begin_step() -> Any:
        t0 = time.perf_counter()
        step = begin()
        started[id(step)] = (t0, step_kind(core, step.sched_out))
        return step

    def finish_step(step: Any) -> Any:
        try:
            return finish(step)
        finally:
            t0, kind = started.pop(id(step), (None, "unknown"))
            if t0 is not None:
                steps.append((kind, time.perf_counter() - t0))
    core.begin_step, core.finish_step = begin_step, finish_step
    return totals, steps


def step_times(steps: list[tuple[str, float]]) -> dict[str, dict[str, float]]:
    """Steps by kind: count, median and total milliseconds."""
    out = {}
    for kind in (*STEP_KINDS, "unknown"):
        ms = [1e3 * t for k, t in steps if k == kind]
        if ms:
            out[kind] = {"steps": len(ms), "median_ms": statistics.median(ms),
                         "total_ms": sum(ms)}
    return out


def spec_counters(llm: Any) -> dict[str, Any]:
    s = llm.engine.scheduler.stats()
    return {"drafts": s.spec_num_drafts, "draft_tokens": s.spec_num_draft_tokens,
            "accepted": s.spec_num_accepted_tokens, "per_pos": list(s.spec_accepted_per_pos)}


def make_params(kind: str, max_tokens: int, n: int, seed: int) -> list[Any]:
    from jaxserve import SamplingParams
    if kind == "greedy":
        return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * n
    return [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_tokens,
                           ignore_eos=True) for i in range(n)]


def run_once(llm: Any, prof: tuple[dict[str, float], list[tuple[str, float]]],
             prompts: list[list[int]], params: list[Any], batch: int) -> dict[str, Any]:
    """The prompts, `batch` at a time (one generate() call each), on a reset prefix
    cache -> per request output and timings, and the run's counters."""
    core = llm.engine
    llm.reset_prefix_cache()
    c0, steps0, toks0 = spec_counters(llm), core.num_steps, core.num_scheduled_tokens
    prof, trace = prof
    compiles0, prof0, first_step = core.num_compilations, dict(prof), len(trace)
    start, t0, cpu0 = cpu_snapshot(), time.perf_counter(), os.times()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + batch]],
                             params[i:i + batch], use_tqdm=False)
    wall = time.perf_counter() - t0
    cpu1 = os.times()
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    c1 = spec_counters(llm)
    reqs = []
    for o in outs:
        m, ids = o.metrics, list(o.outputs[0].token_ids)
        end = m.finished_time if m.finished_time is not None else m.last_token_time
        ttft, e2e = m.first_token_time - m.arrival_time, end - m.arrival_time
        reqs.append({"output": ids, "ttft_s": ttft,
                     "tpot_s": (e2e - ttft) / (len(ids) - 1) if len(ids) > 1 else None})
    steps = core.num_steps - steps0
    return {"requests": reqs, "wall_s": wall, "cpu_s": cpu, "steps": steps,
            "scheduled_tokens": core.num_scheduled_tokens - toks0,
            "compilations": core.num_compilations - compiles0,
            "spec": {k: (c1[k] - c0[k] if k != "per_pos" else
                         [a - b for a, b in zip(c1[k], c0[k] or [0] * len(c1[k]))])
                     for k in c1},
            "host_ms_per_step": {k: 1e3 * (prof.get(k, 0.0) - prof0.get(k, 0.0)) / max(steps, 1)
                                 for k, _, _ in PHASES if k in prof},
            "step_kinds": step_times(trace[first_step:]),
            "other_processes_cores": other_load(start)}


def spec_figures(c: dict[str, Any]) -> dict[str, Any]:
    """Acceptance figures of one run's counters (drafts, draft_tokens, accepted, per_pos)."""
    d = c["drafts"]
    return {"num_drafts": d, "num_draft_tokens": c["draft_tokens"],
            "num_accepted_tokens": c["accepted"],
            "acceptance_rate": c["accepted"] / c["draft_tokens"] if c["draft_tokens"] else None,
            "mean_acceptance_length": 1 + c["accepted"] / d if d else None,
            "acceptance_per_pos": [x / d for x in c["per_pos"]] if d else None}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    reqs = run["requests"]
    out = sum(len(r["output"]) for r in reqs)
    tpot = [1e3 * r["tpot_s"] for r in reqs if r["tpot_s"] is not None]
    ttft = [1e3 * r["ttft_s"] for r in reqs]
    return {"requests": len(reqs), "output_tokens": out, "wall_s": run["wall_s"],
            "out_tok_s": out / run["wall_s"], "cpu_s": run["cpu_s"],
            "tpot_mean_ms": statistics.fmean(tpot) if tpot else None,
            "tpot_median_ms": statistics.median(tpot) if tpot else None,
            "ttft_mean_ms": statistics.fmean(ttft), "ttft_median_ms": statistics.median(ttft),
            "steps": run["steps"], "scheduled_tokens": run["scheduled_tokens"],
            "out_tokens_per_step": out / run["steps"], "compilations": run["compilations"],
            **spec_figures(run["spec"]), "host_ms_per_step": run["host_ms_per_step"],
            "step_kinds": run["step_kinds"],
            "other_processes_cores": run["other_processes_cores"]}


TIMES = ("wall_s", "cpu_s", "out_tok_s", "tpot_mean_ms", "tpot_median_ms", "ttft_mean_ms",
         "ttft_median_ms")


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine's repeats: timings are medians over repeats (each repeat's under
    `repeats`); counts are the first's (they are the same in every repeat for greedy
    requests; for sampled ones too, as each request has its seed)."""
    first = runs[0]
    host = {k: statistics.median(r["host_ms_per_step"][k] for r in runs)
            for k in first["host_ms_per_step"]}
    kinds = {k: {"steps": v["steps"], **{x: statistics.median(
        r["step_kinds"][k][x] for r in runs if k in r["step_kinds"])
        for x in ("median_ms", "total_ms")}} for k, v in first["step_kinds"].items()}
    return {**first, **{k: statistics.median(r[k] for r in runs if r[k] is not None)
                        for k in TIMES if first[k] is not None},
            "host_ms_per_step": host, "step_kinds": kinds,
            "compilations": sum(r["compilations"] for r in runs),
            "other_processes_cores": max(r["other_processes_cores"] or 0 for r in runs),
            "repeats": [{k: r[k] for k in (*TIMES, "steps", "num_accepted_tokens",
                                           "other_processes_cores")} for r in runs]}


def agreement(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Every run of both engines against the base engine's first run, request by request."""
    ref = [r["output"] for r in runs["base"][0]["requests"]]
    first_spec = [r["output"] for r in runs["spec"][0]["requests"]]
    bad = [i for i, (x, y) in enumerate(zip(ref, first_spec)) if x != y]
    pos = [next((j for j, (a, b) in enumerate(zip(ref[i], first_spec[i])) if a != b),
                min(len(ref[i]), len(first_spec[i]))) for i in bad]
    all_same = all([r["output"] for r in run["requests"]] == ref
                   for v in runs.values() for run in v)
    return {"requests": len(ref), "identical_requests": len(ref) - len(bad),
            "identical": not bad and len(ref) == len(first_spec),
            "all_runs_identical": all_same,
            "first_mismatch": {"request": bad[0], "position": pos[0]} if bad else None}


def run_workload(name: str, engines: dict[str, Any], profs: dict[str, Any],
                 prompts: list[list[int]], params: list[Any], batch: int, repeats: int,
                 lookup: tuple[int, int, int]) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ENGINES}
    for rep in range(repeats):
        for k in (ENGINES if rep % 2 == 0 else ENGINES[::-1]):
            runs[k].append(run_once(engines[k], profs[k], prompts, params, batch))
        print(f"{name} repeat {rep + 1}/{repeats}: " + ", ".join(
            f"{k} {runs[k][rep]['wall_s']:.2f} s" for k in ENGINES), file=sys.stderr, flush=True)
    res = {k: pooled([summarize(r) for r in v]) for k, v in runs.items()}
    n_min, n_max, k = lookup
    sims = [simulate(p, r["output"], n_min, n_max, k, sp.max_tokens)
            for p, r, sp in zip(prompts, runs["spec"][0]["requests"], params)]
    sim = add_sims(sims)
    s = res["spec"]
    sim["matches_engine"] = (sim["drafts"] == s["num_drafts"]
                             and sim["draft_tokens"] == s["num_draft_tokens"]
                             and sim["accepted"] == s["num_accepted_tokens"])
    b = res["base"]
    outs = [r["output"] for r in runs["base"][0]["requests"]]
    paired = [rs["out_tok_s"] / rb["out_tok_s"] for rs, rb in zip(s["repeats"], b["repeats"])]
    return {"workload": name, "requests": len(prompts), "batch": batch,
            "sampling": "greedy" if params[0].temperature == 0 else "temperature 1, seeded",
            "prompt_lens": [len(p) for p in prompts], "max_tokens": params[0].max_tokens,
            "runs": res, "agreement": agreement(runs), "simulated": sim,
            "distinct_output_tokens_mean": statistics.fmean(len(set(o)) for o in outs),
            "throughput_ratio": s["out_tok_s"] / b["out_tok_s"],
            "throughput_ratio_paired": statistics.median(paired),
            "throughput_ratio_paired_each": paired,
            "cpu_time_ratio": b["cpu_s"] / s["cpu_s"],
            "tpot_mean_speedup": (b["tpot_mean_ms"] / s["tpot_mean_ms"]
                                  if s["tpot_mean_ms"] else None),
            "tpot_median_speedup": (b["tpot_median_ms"] / s["tpot_median_ms"]
                                    if s["tpot_median_ms"] else None),
            "steps_ratio": s["steps"] / b["steps"]}


def warm_up(llm: Any, tok_prompts: list[list[int]], seed: int) -> None:
    """Untimed: a greedy and a seeded sampled batch, and a batch-1 request."""
    short = [p[:48] for p in tok_prompts[:2]]
    llm.generate([{"prompt_token_ids": p} for p in short], make_params("greedy", 24, 2, 0),
                 use_tqdm=False)
    llm.generate([{"prompt_token_ids": p} for p in short], make_params("t1", 24, 2, seed),
                 use_tqdm=False)
    llm.generate([{"prompt_token_ids": short[0]}], make_params("greedy", 24, 1, 0),
                 use_tqdm=False)
    llm.reset_prefix_cache()


# ---- the report ---------------------------------------------------------------------------
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = ap.add_argument
    a("--output-dir", default="benchmarks/results")
    a("--name", default=None, help="results file name (default spec_decode, "
      "spec_decode_<kind> for another model kind)")
    a("--model-kind", choices=KINDS, default="llama")
    a("--model", default=None, help="checkpoint dir (default: written on first use)")
    a("--seed", type=int, default=0)
    a("--num-spec", type=int, default=3, help="num_speculative_tokens")
    a("--prompt-lookup-min", type=int, default=2)
    a("--prompt-lookup-max", type=int, default=5)
    a("--code-requests", type=int, default=8)
    a("--code-lines", type=int, default=16, help="statements of each prompt's code")
    a("--code-output", type=int, default=256)
    a("--bs1-requests", type=int, default=4, help="code prompts run one at a time (0: skip)")
    a("--random-requests", type=int, default=8)
    a("--random-input", type=int, default=256)
    a("--random-output", type=int, default=256)
    a("--max-num-seqs", type=int, default=8)
    a("--max-num-batched-tokens", type=int, default=512)
    a("--max-model-len", type=int, default=2048)
    a("--page-size", type=int, default=16)
    a("--repeats", type=int, default=7)
    a("--workloads", default=",".join(WORKLOADS), help="which to run, comma-separated")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    chosen = args.workloads.split(",")
    if unknown := sorted(set(chosen) - set(WORKLOADS)):
        ap.error(f"unknown workloads {unknown}: choose from {', '.join(WORKLOADS)}")
    name = args.name or ("spec_decode" if args.model_kind == "llama"
                         else f"spec_decode_{args.model_kind}")

    from transformers import AutoTokenizer

    from benchmarks.shared.workloads import random_workload
    path = model_dir(args.model_kind, args.model)
    vocab = model_vocab(path)
    code = code_prompts(AutoTokenizer.from_pretrained(path), args.code_requests,
                        args.code_lines, args.seed)
    rnd = [it.prompt_token_ids for it in random_workload(
        args.random_requests, args.random_input, args.random_output, 0.0, vocab,
        args.seed + 1).items]
    need = max(max(len(p) for p in code) + args.code_output,
               args.random_input + args.random_output)
    if need > args.max_model_len:
        ap.error(f"--max-model-len {args.max_model_len} is below the longest request ({need})")

    from jaxserve import LLM
    spec = {"method": "ngram", "num_speculative_tokens": args.num_spec,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min}
    kw = dict(dtype="float32", max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              page_size=args.page_size, max_num_batched_tokens=args.max_num_batched_tokens)
    engines, profs, startup = {}, {}, {}
    for k in ENGINES:
        t0 = time.perf_counter()
        engines[k] = LLM(path, speculative_config=spec if k == "spec" else None, **kw)
        startup[k] = time.perf_counter() - t0
    for k in ENGINES:
        t0 = time.perf_counter()
        warm_up(engines[k], rnd, args.seed + 99)
        startup[k] += time.perf_counter() - t0
        profs[k] = instrument(engines[k])

    lookup = (args.prompt_lookup_min, args.prompt_lookup_max, args.num_spec)
    greedy = make_params("greedy", args.code_output, len(code), 0)
    plan = [("code-edit", code, greedy, len(code))]
    if args.bs1_requests:
        n = min(args.bs1_requests, len(code))
        plan.append(("code-edit-bs1", code[:n], greedy[:n], 1))
    plan += [("random", rnd, make_params("greedy", args.random_output, len(rnd), 0), len(rnd)),
             ("random-t1", rnd, make_params("t1", args.random_output, len(rnd), args.seed + 7),
              len(rnd))]
    t_all = time.perf_counter()
    workloads = [run_workload(wname, engines, profs, prompts, params, batch, args.repeats,
                              lookup) for wname, prompts, params, batch in plan
                 if wname in chosen]
    import jax
    num_params = sum(x.size for x in jax.tree.leaves(engines["base"].engine.params)) \
        if hasattr(engines["base"].engine, "params") else 0
    res = {"model": {"kind": args.model_kind, "path": path, "num_params": num_params,
                     "vocab_size": vocab,
                     "config": model_config(args.model_kind) if args.model is None else None},
           "speculative_config": spec, "startup_s": startup,
           "workloads_s": time.perf_counter() - t_all, "workloads": workloads}
    write_results(args.output_dir, name, benchmark="spec_decode", argv=argv, config=vars(args),
                  results=res, table=tables(res), notes=notes(res, args),
                  agreement={w["workload"]: w["agreement"] for w in workloads})
    return res


if __name__ == "__main__":
    main()
