"""benchmarks.serving.startup reads the engine's own warmup summary back (a real run starts
the server twice, see benchmarks/README.md; too slow for a smoke test)."""
from __future__ import annotations

from benchmarks.serving.startup import warmup_counts
from jaxserve.runner.compile_counter import CompileCounts
from jaxserve.runner.warmup_report import WarmupSummary


def summary(backend: int, hits: int) -> str:
    counts = CompileCounts(lowered=backend, backend=backend, cache_hits=hits, cache_writes=0)
    return "INFO " + WarmupSummary(programs=7, seconds=2.5, counts=counts).describe() + "\n"


def test_reads_the_warmup_summary_the_engine_logs():
    assert warmup_counts(summary(9, 0)) == {"programs": 7, "fresh": 9, "from_cache": 0}
    assert warmup_counts(summary(9, 9)) == {"programs": 7, "fresh": 0, "from_cache": 9}
    assert warmup_counts(summary(9, 4)) == {"programs": 7, "fresh": 5, "from_cache": 4}
    assert warmup_counts("no warmup here") is None
