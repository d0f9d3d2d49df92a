"""Put parameters on their devices from host readers: in parallel, each device fetching
only its slice, with a progress bar, a progress hook and one summary log line.

A `ParamTask` knows nothing about checkpoints: `open()` (run in a worker thread)
prepares whatever the host needs and returns `read(index) -> np.ndarray`, the param's
slice at `index` (a tuple of slices) in the target dtype. The checkpoint side lives
in models/weights.py.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import jax
import numpy as np
from tqdm import tqdm

logger = logging.getLogger("jaxserve")

Index = tuple[slice, ...]
Reader = Callable[[Index], np.ndarray]
Progress = Callable[[int, int], None]

# numpy's copies and casts release the GIL and the transfers are asynchronous, so a few
# threads overlap page-cache reads, casts and transfers. Past a handful, host memory
# bandwidth rather than cores is the limit, and each thread holds one tensor in host
# memory, so the count is capped.
MAX_WORKERS = 8


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


@dataclass(frozen=True)
class ParamTask:
    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: jax.sharding.Sharding | None   # None: the default device
    nbytes: int                              # bytes read from the checkpoint, for progress
    num_tensors: int                         # checkpoint tensors feeding this param
    open: Callable[[], Reader]


def full_index(shape: tuple[int, ...]) -> Index:
    return tuple(slice(None) for _ in shape)


def _once_per_index(read: Reader) -> Reader:
    """Devices holding the same slice (a replicated axis) share one host copy."""
    made: dict[tuple, np.ndarray] = {}

    def cached(index: Index) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in made:
            made[key] = read(index)
        return made[key]
    return cached


def place_one(task: ParamTask) -> jax.Array:
    """The param as a jax.Array in its sharding. make_array_from_callback asks only
    for this process's addressable devices' slices (what multi-host needs)."""
    read = task.open()
    if task.sharding is None:   # uncommitted, on the default device, as device_put does
        out = jax.device_put(read(full_index(task.shape)))
    else:
        out = jax.make_array_from_callback(task.shape, task.sharding, _once_per_index(read),
                                           dtype=task.dtype)
    # Wait for the transfer so this thread's host slices are freed before it opens the
    # next tensor: host memory stays bounded by the number of workers.
    return out.block_until_ready()


def place_params(tasks: Sequence[ParamTask], *, workers: int | None = None,
                 progress: Progress | None = None, what: str = "weights"
                 ) -> dict[tuple[str, ...], jax.Array]:
    """path -> array for every task. `workers` threads (None: default_workers());
    `progress(done, total)` in checkpoint bytes, called from this thread: once with 0
    before anything is read, then after each param, ending with done == total."""
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    total = sum(t.nbytes for t in tasks)
    # Largest first: the biggest tensors (embedding, lm_head) never start last and leave
    # one thread finishing alone.
    order = sorted(tasks, key=lambda t: -t.nbytes)
    out: dict[tuple[str, ...], jax.Array] = {}
    done = 0
    t0 = time.perf_counter()
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"loading {what}", disable=None)
    if progress is not None:
        progress(0, total)

    def finished(task: ParamTask, array: jax.Array) -> None:
        nonlocal done
        out[task.path] = array
        done += task.nbytes
        bar.update(task.nbytes)
        if progress is not None:
            progress(done, total)

    try:
        if workers == 1:   # in this thread: no pool, plain tracebacks
            for task in order:
                finished(task, place_one(task))
        else:
            _run_pool(order, workers, finished)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    logger.info("loaded %d tensors, %.2f GiB in %.1f s (%.2f GiB/s, %d threads)",
                sum(t.num_tensors for t in tasks), total / 2**30, seconds,
                total / 2**30 / max(seconds, 1e-9), workers)
    return out


def _run_pool(order: Sequence[ParamTask], workers: int,
              finished: Callable[[ParamTask, jax.Array], None]) -> None:
    """Tasks open their tensors only when a thread runs them, so queued tasks hold no
    memory; the first error cancels what has not started and is raised."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="load-weights")
    try:
        pending: dict[Future, ParamTask] = {pool.submit(place_one, t): t for t in order}
        while pending:
            ready, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in ready:
                finished(pending.pop(fut), fut.result())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
