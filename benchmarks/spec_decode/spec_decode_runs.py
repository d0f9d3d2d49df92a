"""spec_decode's timed engine runs (spec_decode_models' too): the step phases and kinds
instrumented on an engine instance, one run on a reset prefix cache, its summary, an
engine's repeats pooled, and the greedy agreement of both engines."""
from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from benchmarks.shared.results_io import cpu_snapshot, other_load

ENGINES = ("base", "spec")    # without / with speculation
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

