"""Compile many programs at once: lowering is Python (one thread at a time), but XLA's
compilers release the GIL, so a thread pool keeps every core compiling.

A program compiled with `jit(f).lower(*args).compile()` is the one `jit(f)(*args)`
then runs: jax caches the trace, the lowering and the executable, so a call after
this compiles nothing (tests/runner/test_parallel_compile.py holds that).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")

# Each compilation holds its module and the compiler's working memory on the host (a
# few GiB for a large model's forward on TPU), so the pool stays small even on hosts
# with a hundred cores.
MAX_COMPILE_WORKERS = 8


def default_compile_workers() -> int:
    """Threads that compile at once: one per core, at most MAX_COMPILE_WORKERS.
    JAXSERVE_COMPILE_WORKERS overrides it (1: one program after another)."""
    env = os.environ.get("JAXSERVE_COMPILE_WORKERS")
    if env:
        try:
            workers = int(env)
        except ValueError:
            raise ValueError(f"JAXSERVE_COMPILE_WORKERS={env!r}: expected an integer >= 1") from None
        if workers < 1:
            raise ValueError(f"JAXSERVE_COMPILE_WORKERS={env!r}: expected an integer >= 1")
        return workers
    return max(1, min(os.cpu_count() or 1, MAX_COMPILE_WORKERS))


def compile_all(items: Sequence[T], compile_one: Callable[[Any], Any], *, workers: int,
                on_done: Callable[[T, Any, float], None] | None = None,
                prepare: Callable[[T], Any] | None = None) -> list[Any]:
    """compile_one(item) for every item, `workers` at a time; returns the results in the
    order of `items`. on_done(item, result, seconds) runs in the calling thread as each
    finishes (in the order they finish). The first error cancels what has not started
    and is raised once the running ones end.

    prepare: when given, compile_one gets prepare(item) instead of the item, and prepare
    runs in the calling thread, in the order of `items`, while the pool compiles what is
    ready. For work every process of a multi-host run must do in the same order:
    lowering puts arrays on the mesh, which jax checks against every other process
    (a collective), so lowerings racing in threads leave the processes out of step."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    results: list[Any] = [None] * len(items)
    ready = prepare or (lambda item: item)

    def timed(i: int, arg: Any) -> tuple[int, Any, float]:
        start = time.perf_counter()
        out = compile_one(arg)
        return i, out, time.perf_counter() - start

    def finished(i: int, out: Any, seconds: float) -> None:
        results[i] = out
        if on_done is not None:
            on_done(items[i], out, seconds)

    if workers == 1 or len(items) <= 1:   # in this thread: plain tracebacks
        for i in range(len(items)):
            finished(*timed(i, ready(items[i])))
        return results
    pool = ThreadPoolExecutor(max_workers=min(workers, len(items)),
                              thread_name_prefix="compile")
    try:
        pending: set[Future] = set()
        for i in range(len(items)):
            pending.add(pool.submit(timed, i, ready(items[i])))
            done = {f for f in pending if f.done()}
            pending -= done
            for fut in done:
                finished(*fut.result())
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                finished(*fut.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results
