"""Progress of ModelRunner warmup: a log line per slow program (or every few seconds),
a tqdm bar on a terminal, a callback (the engine's StartupProgress listens), and at
the end how many XLA compilations were fresh and how many the persistent compilation
cache supplied."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from typing import Callable

from tqdm.auto import tqdm

from jaxserve.runner import compile_counter
from jaxserve.runner.programs import Program

logger = logging.getLogger("jaxserve")

# on_program(done, total): called before the first program and after each one.
OnProgram = Callable[[int, int], None]

# A program is logged when it took this long, or when this long passed since the last
# line: a cold start on a TPU host says something every few seconds, a warm one is quiet.
_LOG_EVERY_S = 5.0
_SLOW_PROGRAM_S = 1.0


def program_label(p: Program) -> str:
    """e.g. "forward[tokens=256 pages=8]", "sample[penalties][rows=64]"."""
    sizes = [f"{k}={v}" for k, v in (("tokens", p.tokens), ("pages", p.pages),
                                     ("rows", p.rows)) if v is not None]
    return p.name + (f"[{' '.join(sizes)}]" if sizes else "")


@dataclass(frozen=True)
class WarmupSummary:
    programs: int
    seconds: float
    counts: compile_counter.CompileCounts   # during warmup

    def describe(self) -> str:
        c = self.counts
        if c.backend and c.fresh == 0:
            source = (f"all {c.backend} XLA compilations from the persistent compilation "
                      f"cache (0 compiled)")
        else:
            source = (f"{c.fresh} XLA compilations compiled fresh, {c.cache_hits} from the "
                      f"persistent compilation cache")
        return f"warmup: {self.programs} programs, {source} in {self.seconds:.1f} s"


class WarmupReport:
    def __init__(self, num_programs: int, on_program: OnProgram | None = None):
        self.n = num_programs
        self.on_program = on_program
        self._start = self._last_log = time.perf_counter()
        self._before = compile_counter.counts()
        self._done = 0
        # disable=None: a bar only when stderr is a terminal (not in a server's log file).
        self._bar = tqdm(total=num_programs, desc="warmup", unit="program", disable=None)
        if on_program is not None:
            on_program(0, num_programs)

    def program_done(self, prog: Program, seconds: float) -> None:
        self._done += 1
        now = time.perf_counter()
        if (seconds >= _SLOW_PROGRAM_S or now - self._last_log >= _LOG_EVERY_S
                or self._done == self.n):
            self._last_log = now
            logger.info("warmup: program %d/%d %s %.1f s (%.1f s so far)", self._done, self.n,
                        program_label(prog), seconds, now - self._start)
        self._bar.update(1)
        if self.on_program is not None:
            self.on_program(self._done, self.n)

    def finish(self) -> WarmupSummary:
        self._bar.close()
        summary = WarmupSummary(self._done, time.perf_counter() - self._start,
                                compile_counter.counts() - self._before)
        logger.info("%s", summary.describe())
        return summary
