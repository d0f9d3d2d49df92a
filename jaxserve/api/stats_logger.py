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

With speculative decoding, a second line under it, as vLLM's (SpecDecodingLogging),
over the same interval, when drafts were verified in it:

    SpecDecoding metrics: Mean acceptance length: 2.40, Accepted throughput: 3.50
    tokens/s, Drafted throughput: 7.50 tokens/s, Accepted: 35 tokens, Drafted: 75
    tokens, Per-position acceptance rate: 0.720, 0.440, 0.240, Avg Draft acceptance
    rate: 46.7%

Mean acceptance length is 1 + accepted / drafts (with the token the verifying step
samples after the accepted drafts, as vLLM counts it); a draft is one request's
proposal in one step, of up to num_speculative_tokens tokens. Per-position rates are
the drafts whose token at that position was accepted, over all drafts.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

from jaxserve.core.scheduler import SchedulerStats

logger = logging.getLogger("jaxserve")


def stats_line(stats: SchedulerStats, prompt_tps: float, generation_tps: float,
               engine_index: int = 0) -> str:
    return (f"Engine {engine_index:03d}: Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
            f"Avg generation throughput: {generation_tps:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {stats.prefix_cache_hit_rate * 100:.1f}%"
            + ("" if stats.host is None else
               f", External prefix cache hit rate: {stats.host.hit_rate * 100:.1f}%"))


def spec_decoding_line(last: SchedulerStats, stats: SchedulerStats,
                       elapsed: float) -> str | None:
    """vLLM's SpecDecoding line over the interval from `last` to `stats` (elapsed
    seconds); None without speculative decoding or without drafts in the interval."""
    num_spec = len(stats.spec_accepted_per_pos)
    num_drafts = stats.spec_num_drafts - last.spec_num_drafts
    if not num_spec or num_drafts <= 0:
        return None
    drafted = stats.spec_num_draft_tokens - last.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens
    before = tuple(last.spec_accepted_per_pos)[:num_spec]
    before += (0,) * (num_spec - len(before))
    per_pos = [(now - then) / num_drafts
               for now, then in zip(stats.spec_accepted_per_pos, before)]
    accepted_tps = accepted / elapsed if elapsed > 0 else 0.0
    drafted_tps = drafted / elapsed if elapsed > 0 else 0.0
    rate = accepted / drafted * 100 if drafted > 0 else float("nan")
    return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / num_drafts:.2f}, "
            f"Accepted throughput: {accepted_tps:.2f} tokens/s, "
            f"Drafted throughput: {drafted_tps:.2f} tokens/s, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
            f"Per-position acceptance rate: {', '.join(f'{p:.3f}' for p in per_pos)}, "
            f"Avg Draft acceptance rate: {rate:.1f}%")


class StatsLogger:
    """engine: anything with `stats` (a SchedulerStats snapshot, e.g. AsyncEngine's
    EngineStats) and `dead`. Held weakly: the thread ends with the engine, when it
    stops (dead) or is dropped."""

    def __init__(self, engine: Any, interval: float = 10.0, engine_index: int = 0):
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
        """Reads the engine's stats; logs and returns the line (and the SpecDecoding line,
        when there is one, as a second log record: returned after a newline), or None
        when idle."""
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
        spec = spec_decoding_line(last, stats, elapsed)
        if spec is not None:
            logger.info("%s", spec)
            line = f"{line}\n{spec}"
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
