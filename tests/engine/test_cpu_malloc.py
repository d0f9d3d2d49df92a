"""A CPU engine keeps freed memory in glibc's heap (jaxserve/build/cpu_malloc.py): a large
buffer is no longer a fresh mmap whose pages fault in one by one on every step."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from jaxserve.build import cpu_malloc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Counts glibc's mmapped blocks around a 64 MiB allocation (numpy takes it from malloc).
PROBE = """
    import ctypes
    import numpy as np
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    def mapped_by_64_mib():
        before = libc.mallinfo2().hblks
        buf = np.ones(64 << 20, np.uint8)
        return libc.mallinfo2().hblks - before
"""

pytestmark = pytest.mark.skipif(cpu_malloc._glibc() is None, reason="not glibc")


def _run(code: str, **env: str) -> list[str]:
    full = {k: v for k, v in os.environ.items() if k != cpu_malloc.ENV}
    full.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + full.get("PYTHONPATH", ""),
                **env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE) + textwrap.dedent(code)],
                         env=full, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def test_a_cpu_engine_stops_mapping_each_large_buffer():
    got = _run("""
        before = mapped_by_64_mib()
        from jaxserve import LLM
        from jaxserve.checkpoints.default_model import default_model_dir
        LLM(default_model_dir(), load_format="dummy", max_num_seqs=2, enforce_eager=True,
            max_model_len=32)
        print(before, mapped_by_64_mib())
    """)
    assert got[-1] == "1 0", got   # glibc's default mmaps it; after the engine's start, not


def test_the_environment_can_leave_malloc_alone():
    got = _run("""
        from jaxserve.build.cpu_malloc import keep_freed_memory
        print(keep_freed_memory(), mapped_by_64_mib())
    """, **{cpu_malloc.ENV: "default"})
    assert got[-1] == "None 1", got
    got = _run("""
        from jaxserve.build.cpu_malloc import keep_freed_memory
        print(bool(keep_freed_memory()), mapped_by_64_mib())
    """)
    assert got[-1] == "True 0", got
