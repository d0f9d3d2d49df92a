"""The timing drives: compile of each grammar kind (cold, through the library's cache,
from what a server keeps) and the per-step mask fill + consume along a valid instance,
one row and batched. Every mask is checked to allow the next token, so a fast but
wrong backend cannot pass for a fast one."""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from benchmarks.structured.grammar_adapters import Backend, CompileError
from benchmarks.structured.grammar_fixtures import Grammar, grammar_kinds, schema_grammar


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Garbage collection off while timing: a collection inside one step is noise. No
    gc.collect() first: it walks the whole heap, 2-3 s a call inside a test worker that
    has run a hundred files (tests/benchmarks/test_grammar_backends.py's run took 39-51 s
    in the suite against 1.8 s alone), and disabled is all the timing needs."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter_ns()
    out = fn()
    return out, (time.perf_counter_ns() - t0) / 1e9


def _stats_us(samples_ns: Sequence[int]) -> dict[str, float]:
    us = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return {"mean_us": float(us.mean()), "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99)), "max_us": float(us.max()),
            "steps": int(us.size)}


def token_allowed(bits: np.ndarray, row: int, token: int) -> bool:
    """Bit `token` of mask row `row` (bit b of int32 word w is token 32 w + b)."""
    return bool((int(bits[row, token >> 5]) >> (token & 31)) & 1)


def measure_compile(backend: Backend, grammars: dict[str, Grammar], repeats: int
                    ) -> dict[str, Any]:
    """Per grammar: cold compile (+ first mask), a second compile through the library's
    own cache, and a matcher from what a server keeps (+ first mask); seconds, with the
    median over `repeats` and every sample."""
    out: dict[str, Any] = {}
    for label, g in grammars.items():
        samples: dict[str, list[float]] = {k: [] for k in (
            "cold_s", "cold_first_mask_s", "again_s", "kept_s", "kept_first_mask_s")}
        try:
            for _ in range(repeats):
                bitmask = backend.new_bitmask(1)
                with no_gc():
                    (matcher, kept), t = timed(lambda: backend.compile_cold(g))
                    samples["cold_s"].append(t)
                    samples["cold_first_mask_s"].append(
                        timed(lambda: backend.fill(matcher, bitmask, 0))[1])
                    samples["again_s"].append(timed(lambda: backend.compile_again(g))[1])
                    matcher2, t = timed(lambda: backend.from_kept(kept))
                    samples["kept_s"].append(t)
                    samples["kept_first_mask_s"].append(
                        timed(lambda: backend.fill(matcher2, bitmask, 0))[1])
        except CompileError as e:
            out[label] = {"kind": g.kind, "error": str(e)[:500]}
            continue
        out[label] = {"kind": g.kind, **{k: statistics.median(v) for k, v in samples.items()},
                      "samples": samples}
    return out


def measure_schema_parts(backend: Backend, schema: dict[str, Any], repeats: int
                         ) -> dict[str, Any]:
    """Cold compile (median, seconds) of each property of `schema` alone, as a required
    property of an object: which keyword costs a backend its compile time."""
    out: dict[str, Any] = {}
    for prop, sub in schema["properties"].items():
        g = schema_grammar({"type": "object", "properties": {prop: sub}, "required": [prop]})
        try:
            out[prop] = statistics.median(timed(lambda: backend.compile_cold(g))[1]
                                          for _ in range(repeats))
        except CompileError as e:
            out[prop] = f"error: {e}"[:200]
    return out


def drive_one(backend: Backend, kept: Any, tokens: list[int], passes: int,
              first: Any | None = None) -> dict[str, Any]:
    """One row through `tokens` `passes` times, a new matcher each pass (`first`, the
    matcher just compiled, for the first pass when given): per step the mask fill alone
    and fill + consume, in ns; whether every mask allowed the next token."""
    bitmask = backend.new_bitmask(1)
    bits = backend.bits(bitmask)
    fill_ns: list[list[int]] = []
    step_ns: list[list[int]] = []
    disallowed: list[tuple[int, int]] = []
    rejected: list[tuple[int, int]] = []
    for p in range(passes):
        m = first if (p == 0 and first is not None) else backend.from_kept(kept)
        f_row, s_row = [], []
        with no_gc():
            for i, t in enumerate(tokens):
                t0 = time.perf_counter_ns()
                backend.fill(m, bitmask, 0)
                t1 = time.perf_counter_ns()
                ok = backend.consume(m, t)
                t2 = time.perf_counter_ns()
                f_row.append(t1 - t0)
                s_row.append(t2 - t0)
                if not token_allowed(bits, 0, t):
                    disallowed.append((p, i))
                if not ok:
                    rejected.append((p, i))
        if not backend.is_done(m):
            rejected.append((p, len(tokens)))
        fill_ns.append(f_row)
        step_ns.append(s_row)
    return {"fill_ns": fill_ns, "step_ns": step_ns, "disallowed": disallowed,
            "rejected": rejected}


def drive_batch(backend: Backend, kept: Any, tokens: list[int], rows: int, steps: int
                ) -> dict[str, Any]:
    """`rows` matchers, row r starting r/rows of the way along `tokens` (advanced there
    untimed); per batch step the batched fill, then the batched consume. A row that has
    consumed EOS restarts with a new matcher (untimed)."""
    n = len(tokens)
    bitmask = backend.new_bitmask(rows)
    bits = backend.bits(bitmask)
    pos = [r * n // rows for r in range(rows)]
    matchers = []
    for r in range(rows):
        m = backend.from_kept(kept)
        for t in tokens[:pos[r]]:
            backend.consume(m, t)
        matchers.append(m)
    fill_ns, step_ns, disallowed, rejected = [], [], 0, 0
    row_ids = np.arange(rows)
    with no_gc():
        for _ in range(steps):
            nxt = [tokens[p] for p in pos]
            t0 = time.perf_counter_ns()
            backend.fill_batch(matchers, bitmask)
            t1 = time.perf_counter_ns()
            oks = backend.consume_batch(matchers, nxt)
            t2 = time.perf_counter_ns()
            fill_ns.append(t1 - t0)
            step_ns.append(t2 - t0)
            toks = np.asarray(nxt)
            words = bits[row_ids, toks >> 5].astype(np.int64)
            disallowed += int(np.count_nonzero(((words >> (toks & 31)) & 1) == 0))
            rejected += sum(1 for ok in oks if not ok)
            for r in range(rows):
                pos[r] += 1
                if pos[r] == n:
                    if not backend.is_done(matchers[r]):
                        rejected += 1
                    matchers[r] = backend.from_kept(kept)
                    pos[r] = 0
    return {"fill_ns": fill_ns, "step_ns": step_ns, "disallowed": disallowed,
            "rejected": rejected}


def slowest_steps(backend: Backend, tokens: list[int], step_ns: list[list[int]], k: int = 5
                  ) -> list[dict[str, Any]]:
    """The `k` steps of the 1-row drive with the largest median time over the passes
    after the first (all passes if there is one): where a backend spends its time."""
    later = np.asarray(step_ns[1:] or step_ns, dtype=np.float64) / 1e3
    med = np.median(later, axis=0)
    out = []
    for i in np.argsort(-med)[:k]:
        i = int(i)
        out.append({"step": i, "after": backend.hf.decode(tokens[:i])[-24:],
                    "token": backend.hf.decode(tokens[i:i + 1]), "median_us": float(med[i])})
    return out


def _later_passes(per_pass: list[list[int]]) -> list[int]:
    """The samples of the passes after the first (the first alone if there is one)."""
    return [x for row in per_pass[1:] for x in row] or per_pass[0]


def measure_masks(backend: Backend, tokens: list[int], passes: int, batch_rows: Sequence[int],
                  batch_steps: int, batch_threads: Sequence[int]) -> dict[str, Any]:
    """Mask fill + consume per step for the medium schema: 1 row, and batched for each
    of `batch_rows` with each number of threads of `batch_threads`."""
    g = grammar_kinds()["json_schema (medium)"]
    first, kept = backend.compile_cold(g)
    one = drive_one(backend, kept, tokens, passes, first=first)
    warm_fill, warm_step = (_later_passes(one[k]) for k in ("fill_ns", "step_ns"))
    out: dict[str, Any] = {
        "tokens_per_pass": len(tokens),
        "rows_1": {"first_pass_step": _stats_us(one["step_ns"][0]),
                   "fill": _stats_us(warm_fill), "step": _stats_us(warm_step),
                   "first_pass_total_ms": sum(one["step_ns"][0]) / 1e6,
                   "later_pass_total_ms": (statistics.median(sum(r) for r in one["step_ns"][1:])
                                           / 1e6 if passes > 1 else None),
                   "passes": passes, "disallowed_steps": len(one["disallowed"]),
                   "rejected_tokens": len(one["rejected"]),
                   "first_disallowed": one["disallowed"][:5],
                   "slowest_steps": slowest_steps(backend, tokens, one["step_ns"])},
    }
    out["batched"] = {}
    for threads in batch_threads:
        backend.set_batch_threads(threads)
        by_rows = out["batched"][f"threads_{threads}"] = {}
        for rows in batch_rows:
            b = drive_batch(backend, kept, tokens, rows, batch_steps)
            step = _stats_us(b["step_ns"])
            by_rows[f"rows_{rows}"] = {"fill": _stats_us(b["fill_ns"]), "step": step,
                                       "per_row_step_mean_us": step["mean_us"] / rows,
                                       "disallowed_steps": b["disallowed"],
                                       "rejected_tokens": b["rejected"]}
    backend.set_batch_threads(backend.threads)
    return out
