"""The periodic stats line vLLM users know from their server's log:

    Engine 000: Avg prompt throughput: 12.3 tokens/s, Avg generation throughput: 45.6
    tokens/s, Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit
    rate: 50.0%

(one line), logged by the "jaxserve" logger every `interval` seconds from a daemon
thread while the engine runs. An idle engine logs nothing: a line is written when
tokens were processed since the previous one or requests run or wait, and once more
after that, so the log shows the throughput falling to zero.

Throughputs are over the interval since the previous tick; the hit rate is over
every prefix-cache look-up since start (in tokens). Running and waiting count
sequences (n per prompt), as vLLM counts its child requests.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref

from jaxserve.core.scheduler import SchedulerStats

logger = logging.getLogger("jaxserve")


def stats_line(stats: SchedulerStats, prompt_tps: float, generation_tps: float,
               engine_index: int = 0) -> str:
    return (f"Engine {engine_index:03d}: Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
            f"Avg generation throughput: {generation_tps:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {stats.prefix_cache_hit_rate * 100:.1f}%")


class StatsLogger:
    """engine: anything with `stats` (a SchedulerStats snapshot, e.g. AsyncEngine's
    EngineStats) and `dead`. Held weakly: the thread ends with the engine, when it
    stops (dead) or is dropped."""

    def __init__(self, engine, interval: float = 10.0, engine_index: int = 0):
        if interval <= 0:
            raise ValueError(f"the stats interval must be positive, got {interval}")
        self.interval = interval
        self.engine_index = engine_index
        self._engine = weakref.ref(engine)
        # The previous tick's snapshot and time.monotonic(); at first, the engine's start
        # (its totals from zero).
        self._last = SchedulerStats()
        self._last_time = time.monotonic()
        self._was_busy = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self, now: float | None = None) -> str | None:
        """Reads the engine's stats; logs and returns the line, or None when idle."""
        engine = self._engine()
        if engine is None:
            return None
        stats: SchedulerStats = engine.stats
        now = time.monotonic() if now is None else now
        last, elapsed = self._last, now - self._last_time
        self._last, self._last_time = stats, now
        prompt_tps = generation_tps = 0.0
        if elapsed > 0:
            prompt_tps = (stats.num_prompt_tokens - last.num_prompt_tokens) / elapsed
            generation_tps = (stats.num_generation_tokens - last.num_generation_tokens) / elapsed
        busy = bool(prompt_tps > 0 or generation_tps > 0 or stats.num_running
                    or stats.num_waiting)
        was_busy, self._was_busy = self._was_busy, busy
        if not busy and not was_busy:
            return None
        line = stats_line(stats, prompt_tps, generation_tps, self.engine_index)
        logger.info("%s", line)
        return line

    # ---- the thread --------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="jaxserve-stats", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            engine = self._engine()
            try:
                if engine is None or engine.dead:
                    return
                del engine   # (the weak reference must not be pinned while waiting)
                self.tick()
            except Exception:   # noqa: BLE001 - a log line must never take anything down
                logger.warning("stats logging stopped", exc_info=True)
                return
