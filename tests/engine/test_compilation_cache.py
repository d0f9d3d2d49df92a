"""The persistent compilation cache: a second engine process on the same directory
compiles nothing fresh, and says so in the numbers it exposes. Each engine runs in its
own process, so that no in-memory jit cache can stand in for the persistent one."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from jaxserve.build import startup

# Builds the built-in tiny model's engine (few buckets: few programs) through make_engine
# with a StartupProgress, and prints what it reports.
WORKER = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
from jaxserve.config import EngineConfig
from jaxserve.checkpoints.default_model import default_model_dir
from jaxserve.engine.data_parallel import make_engine
from jaxserve.build.startup import StartupProgress
seen = []
progress = StartupProgress(on_change=lambda s: seen.append([s.phase, s.done, s.total]))
core = make_engine(EngineConfig(
    model=default_model_dir(), load_format="dummy", max_num_seqs=8, max_num_batched_tokens=32,
    max_model_len=128, compilation_cache_dir=sys.argv[1]), progress=progress)
print("RESULT " + json.dumps({
    "programs": len(core.runner.warmup_programs()), "lowered": core.info.warmup_compilations,
    "hits": core.info.warmup_cache_hits, "fresh": core.info.warmup_fresh_compilations,
    "phases": seen}))
"""


def run_engine(cache_dir: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", WORKER, cache_dir], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return {**json.loads(line[len("RESULT "):]), "log": proc.stderr}


def test_second_start_compiles_nothing_fresh(tmp_path):
    cache = str(tmp_path / "xla")
    cold = run_engine(cache)
    assert cold["hits"] == 0 and cold["fresh"] >= cold["programs"] > 0
    assert os.listdir(cache), "the first start wrote nothing to the cache"
    warm = run_engine(cache)
    assert warm["fresh"] == 0
    assert warm["hits"] == cold["fresh"]            # every program, from the cache
    assert warm["lowered"] == cold["lowered"]       # (jit still traces and lowers each)
    assert (f"all {warm['hits']} XLA compilations from the persistent compilation cache "
            f"(0 compiled)") in warm["log"]

    # The phases, in order; compiling counts every program, then the engine is ready.
    phases = [p for p, _, _ in warm["phases"]]
    order = [startup.STARTING, startup.LOADING_WEIGHTS, startup.ALLOCATING_KV_CACHE,
             startup.COMPILING, startup.READY]
    assert [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p] == order
    counted = [(done, total) for p, done, total in warm["phases"]
               if p == startup.COMPILING and total is not None]
    n = warm["programs"]
    assert counted == [(i, n) for i in range(n + 1)]
