"""How long the host tier's restores take to reach the device: a histogram of transfer times.

A restore's send (runner/host_tier.HostTier.dispatch) only starts its host->device
transfers; the step that sends does not wait for them, so the host's dispatch time says
nothing of the transfer. A daemon thread waits for each send's staged rows instead
(`jax.block_until_ready`, which releases the GIL) and files the time since the send
began into fixed buckets (core/host_cache.RESTORE_TIME_BUCKETS), which the engine's
statistics carry to /metrics as a Prometheus histogram. The staged rows are never
donated (the scatter donates the caches), so waiting on them is safe.
"""
from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
from typing import Any

import jax

from jaxserve.core.host_cache import RESTORE_TIME_BUCKETS

logger = logging.getLogger(__name__)


class TransferTimer:
    """Times each watched transfer on a thread of its own; `counts()` is a snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets = [0] * (len(RESTORE_TIME_BUCKETS) + 1)   # the last: +Inf
        self._sum = 0.0
        self._queue: queue.SimpleQueue[tuple[float, Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None   # started by the first watch

    def watch(self, started: float, arrays: Any) -> None:
        """Times `arrays` (any pytree of jax arrays) from `started` (time.perf_counter())
        until they are all ready."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jaxserve-restore-timer",
                                            daemon=True)
            self._thread.start()
        self._queue.put((started, arrays))

    def counts(self) -> tuple[tuple[int, ...], float]:
        """(per-bucket counts, RESTORE_TIME_BUCKETS then +Inf; the sum of the times)."""
        with self._lock:
            return tuple(self._buckets), self._sum

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Waits until every transfer watched so far is filed (tests); -> whether it was."""
        if self._thread is None:
            return True
        done = threading.Event()
        self._queue.put((-1.0, done))
        return done.wait(timeout)

    def close(self) -> None:
        """Stops the thread once what it was given is filed (a later watch starts one)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            started, arrays = item
            if isinstance(arrays, threading.Event):   # wait_idle's marker
                arrays.set()
                continue
            try:
                jax.block_until_ready(arrays)
            except Exception:   # a failed transfer: the step that scatters it fails too
                logger.debug("restore transfer failed; not timed", exc_info=True)
                continue
            self._file(time.perf_counter() - started)

    def _file(self, seconds: float) -> None:
        with self._lock:
            self._buckets[bisect.bisect_left(RESTORE_TIME_BUCKETS, seconds)] += 1
            self._sum += seconds
