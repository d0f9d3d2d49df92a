"""One OpenBLAS thread for XLA:CPU's LAPACK calls.

XLA:CPU runs the few LAPACK calls a model makes (the DeltaNet prefill's triangular solve,
`lax.linalg.triangular_solve`) through jaxlib's LAPACK kernels, which call scipy's bundled
OpenBLAS. Its worker threads spin after each call, beside XLA's own threads: on a 2-core
host a prompt needing ~60 ms of work took 1-3 s (perf: 75-95 % of samples in OpenBLAS's
spinning workers; benchmarks/README.md, "Images: time to first token"). The solves are
small (one chunk of 64 tokens), so one thread loses nothing. OPENBLAS_NUM_THREADS, when
set, is the user's choice and is left alone.
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os

ENV = "OPENBLAS_NUM_THREADS"


def _scipy_openblas() -> ctypes.CDLL | None:
    """scipy's bundled OpenBLAS (the library jaxlib's LAPACK kernels call), or None.
    scipy comes with jax; its package is only located here, not imported."""
    spec = importlib.util.find_spec("scipy")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = os.path.dirname(list(spec.submodule_search_locations)[0])
    for path in sorted(glob.glob(os.path.join(root, "scipy.libs", "libscipy_openblas*.so*"))):
        lib = ctypes.CDLL(path)   # the process's copy when scipy already loaded it
        if hasattr(lib, "scipy_openblas_set_num_threads"):
            return lib
    return None


def openblas_threads() -> int | None:
    """scipy's OpenBLAS thread count, or None when it is not found."""
    lib = _scipy_openblas()
    return None if lib is None else int(lib.scipy_openblas_get_num_threads())


def limit_openblas_threads() -> str | None:
    """scipy's OpenBLAS to one thread (the module doc says why); the log line saying so,
    or None when there is nothing to do (OPENBLAS_NUM_THREADS set, no such library, or
    already one thread)."""
    if os.environ.get(ENV):
        return None
    lib = _scipy_openblas()
    if lib is None:
        return None
    before = int(lib.scipy_openblas_get_num_threads())
    if before <= 1:
        return None
    lib.scipy_openblas_set_num_threads(1)
    return (f"CPU: scipy's OpenBLAS, which runs XLA's LAPACK calls, set to 1 thread (was "
            f"{before}): its idle workers spin and starve XLA's threads ({ENV} overrides)")
