"""glibc's malloc on a CPU engine: freed memory kept for the next step, not unmapped.

XLA:CPU takes each execution's large buffers (a prefill's activations, a program's
temporaries) from malloc. glibc serves a request above its mmap threshold (32 MiB at
most) with a fresh mmap and unmaps it when freed, so every step writes to new pages,
which the kernel faults in and zeroes one 4 KiB page at a time: writing a [1024, 12288]
float32 dot output took 19 ms that way and 1.9 ms in reused memory; decode steps of a
model of Qwen3-8B's layer widths ran 5-9 % faster without the faults, its prefill step
unchanged within the noise (benchmarks/README.md). With mmap off (M_MMAP_MAX 0) and
trimming as good as off (M_TRIM_THRESHOLD 2 GiB), freed blocks stay in the heap for the
next step, as tcmalloc (which vLLM's CPU build preloads) keeps them. The price: the process holds
on to its peak heap. JAXSERVE_CPU_MALLOC=default leaves malloc as it is.
"""
from __future__ import annotations

import ctypes
import os

ENV = "JAXSERVE_CPU_MALLOC"
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4     # glibc's mallopt parameters (malloc.h)
TRIM_THRESHOLD = 2**31 - 1                # mallopt takes an int


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.gnu_get_libc_version   # glibc's own names: not musl or macOS
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> str | None:
    """Turn glibc's per-allocation mmap and its trimming off (the module doc says why);
    the log line saying so, or None when there is nothing to do (not glibc, or the
    environment asks to leave malloc alone)."""
    if os.environ.get(ENV, "") == "default":
        return None
    libc = _glibc()
    if libc is None:
        return None
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "CPU: glibc refused mallopt: each step's large buffers are mapped afresh"
    return (f"CPU: malloc keeps freed memory for the next step (glibc's mmap per large "
            f"buffer and its trimming off: fresh pages cost a page fault each); "
            f"{ENV}=default leaves malloc as it is")
