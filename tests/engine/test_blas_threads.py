"""scipy's OpenBLAS (XLA:CPU's LAPACK calls: the DeltaNet prefill's triangular solve) runs
one thread once a CPU engine is built: its spinning workers starved XLA's threads (a
request's ~60 ms of work took 1-3 s on two cores); OPENBLAS_NUM_THREADS is left alone."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from jaxserve.build import blas_threads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k != blas_threads.ENV}
    full.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + full.get("PYTHONPATH", ""),
                **env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(blas_threads.openblas_threads() is None,
                    reason="scipy's bundled OpenBLAS is not installed")
def test_a_cpu_engine_runs_openblas_on_one_thread():
    # Two threads to start with whatever the host's cores, so the engine must change it.
    got = _run("""
        from jaxserve.build import blas_threads
        blas_threads._scipy_openblas().scipy_openblas_set_num_threads(2)
        before = blas_threads.openblas_threads()
        from jaxserve import LLM
        from jaxserve.checkpoints.default_model import default_model_dir
        LLM(default_model_dir(), load_format="dummy", max_num_seqs=2, enforce_eager=True,
            max_model_len=32)
        print(before, blas_threads.openblas_threads(), blas_threads.limit_openblas_threads())
    """)
    assert got == "2 1 None"


@pytest.mark.skipif(blas_threads.openblas_threads() is None,
                    reason="scipy's bundled OpenBLAS is not installed")
def test_openblas_num_threads_is_the_users_choice():
    got = _run("""
        from jaxserve.build import blas_threads
        print(blas_threads.limit_openblas_threads(), blas_threads.openblas_threads())
    """, OPENBLAS_NUM_THREADS="2")
    assert got == "None 2"
