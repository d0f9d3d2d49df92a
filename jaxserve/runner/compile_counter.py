"""Counts XLA compilations in this process through jax.monitoring.

Every jit cache miss lowers a jaxpr to an MLIR module (even when the persistent
compilation cache then supplies the binary), so that event is what
num_compilations counts. Each lowered module then goes to the backend
("backend compile", which first looks in the persistent cache): the ones the
cache supplied are the cache hits, the rest were compiled fresh by XLA.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from jax import monitoring

_LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"   # cache look-up included
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_CACHE_WRITE = "/jax/compilation_cache/cache_misses"   # recorded when an entry is written

_lock = threading.Lock()
_counts = {_LOWERED: 0, _BACKEND_COMPILE: 0, _CACHE_HIT: 0, _CACHE_WRITE: 0}


@dataclass(frozen=True)
class CompileCounts:
    lowered: int           # jit cache misses (jaxpr -> MLIR)
    backend: int           # modules handed to the backend (persistent cache hits included)
    cache_hits: int        # ... of which the persistent compilation cache supplied
    cache_writes: int      # fresh compilations written to the persistent cache

    @property
    def fresh(self) -> int:
        """Modules XLA compiled in this process (not from the persistent cache)."""
        return self.backend - self.cache_hits

    def __sub__(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(self.lowered - other.lowered, self.backend - other.backend,
                             self.cache_hits - other.cache_hits,
                             self.cache_writes - other.cache_writes)


def _count(event: str, *args, **kwargs) -> None:
    if event in _counts:
        with _lock:
            _counts[event] += 1


monitoring.register_event_listener(_count)
monitoring.register_event_duration_secs_listener(_count)


def counts() -> CompileCounts:
    with _lock:
        return CompileCounts(_counts[_LOWERED], _counts[_BACKEND_COMPILE], _counts[_CACHE_HIT],
                             _counts[_CACHE_WRITE])


def num_compilations() -> int:
    """Compilations (jit cache misses) seen in this process so far."""
    return counts().lowered
