"""Old home of StartupProgress (now `jaxserve.build.startup`), kept for api/."""
from __future__ import annotations

from jaxserve.build.startup import (ALLOCATING_KV_CACHE, COMPILING, FAILED, LOADING_WEIGHTS,
                                    READY, STARTING, StartupProgress, StartupSnapshot)

__all__ = ["ALLOCATING_KV_CACHE", "COMPILING", "FAILED", "LOADING_WEIGHTS", "READY",
           "STARTING", "StartupProgress", "StartupSnapshot"]
