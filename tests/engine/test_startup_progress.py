"""StartupProgress: phases, counts and the change callback, read from another thread."""
from __future__ import annotations

import threading

from jaxserve.build.startup import COMPILING, LOADING_WEIGHTS, STARTING, StartupProgress


def test_phases_counts_and_callback():
    seen = []
    p = StartupProgress(on_change=seen.append)
    assert (p.phase, p.snapshot().done) == (STARTING, None)
    p.set_phase(LOADING_WEIGHTS, "weights of /m")
    p.set_phase(COMPILING, "listing", total=3)
    p.advance(2, 3, "compiling program 3 of 3")
    snap = p.snapshot()
    assert (snap.phase, snap.detail, snap.done, snap.total) == (
        COMPILING, "compiling program 3 of 3", 2, 3)
    assert [(s.phase, s.done, s.total) for s in seen] == [
        (LOADING_WEIGHTS, None, None), (COMPILING, 0, 3), (COMPILING, 2, 3)]
    assert seen[-1].seconds >= seen[0].seconds >= 0
    assert set(snap.as_dict()) == {"phase", "detail", "done", "total", "seconds"}


def test_snapshots_are_consistent_under_a_concurrent_writer():
    """A reader never sees done of one update with total or detail of another."""
    p = StartupProgress()
    stop = threading.Event()

    def write():
        i = 0
        while not stop.is_set():
            i += 1
            p.advance(i, i, f"step {i}")
    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(20000):
            s = p.snapshot()
            if s.done is not None:
                assert s.done == s.total and s.detail == f"step {s.done}"
    finally:
        stop.set()
        writer.join()


def test_weight_loading_reports_bytes(checkpoint, monkeypatch):
    """Loading a checkpoint advances the loading phase in bytes, ending at the total
    (what /health shows while a large model loads)."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine_core import EngineCore
    from jaxserve.runner.model_runner import ModelRunner
    monkeypatch.setattr(ModelRunner, "warmup", lambda self, *a, **k: self.allocate_caches())
    seen = []
    progress = StartupProgress(on_change=seen.append)
    EngineCore(EngineConfig(model=checkpoint("qwen3"), max_model_len=64, max_num_seqs=4,
                            compilation_cache_dir=None), progress=progress)
    loading = [(s.done, s.total) for s in seen if s.phase == LOADING_WEIGHTS and s.total]
    assert loading[0][0] == 0 and loading[-1][0] == loading[-1][1] > 0
    assert [d for d, _ in loading] == sorted(d for d, _ in loading)
    assert "GiB of weights" in [s for s in seen if s.phase == LOADING_WEIGHTS][-1].detail
