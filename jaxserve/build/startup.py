"""StartupProgress: what an engine under construction is doing, for whoever waits on it.

The engine sets the phase (loading weights, allocating the KV cache, compiling) and,
while compiling, program i of n; the server reads snapshots from another thread to
answer /health with them. Imports nothing heavy: the server holds one before jax loads.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

STARTING = "starting"
LOADING_WEIGHTS = "loading_weights"
ALLOCATING_KV_CACHE = "allocating_kv_cache"
COMPILING = "compiling"
READY = "ready"
FAILED = "failed"


@dataclass(frozen=True)
class StartupSnapshot:
    phase: str
    detail: str
    done: int | None       # units of the phase finished (compiling: programs), if counted
    total: int | None
    seconds: float         # since the progress object was made

    def as_dict(self) -> dict:
        return {"phase": self.phase, "detail": self.detail, "done": self.done,
                "total": self.total, "seconds": round(self.seconds, 1)}


class StartupProgress:
    """Thread-safe; written by the thread building the engine, read by any other.

    on_change: called (in the writer's thread) with each new snapshot."""

    def __init__(self, on_change: Callable[[StartupSnapshot], None] | None = None):
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._phase, self._detail = STARTING, ""
        self._done: int | None = None
        self._total: int | None = None
        self._on_change = on_change

    def set_phase(self, phase: str, detail: str = "", *, total: int | None = None) -> None:
        with self._lock:
            self._phase, self._detail = phase, detail
            self._done, self._total = (0 if total is not None else None), total
        self._changed()

    def advance(self, done: int, total: int, detail: str) -> None:
        """`done` of `total` units of the current phase are finished; detail says what
        happens now."""
        with self._lock:
            self._done, self._total, self._detail = done, total, detail
        self._changed()

    def snapshot(self) -> StartupSnapshot:
        with self._lock:
            return StartupSnapshot(self._phase, self._detail, self._done, self._total,
                                   time.monotonic() - self._start)

    @property
    def phase(self) -> str:
        with self._lock:
            return self._phase

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.snapshot())
