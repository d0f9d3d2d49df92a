"""Counts XLA compilations in this process through jax.monitoring.

Every jit cache miss lowers a jaxpr to an MLIR module (even when the persistent
compilation cache then supplies the binary), so that event is what we count.
"""
from __future__ import annotations

import threading

from jax import monitoring

_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_lock = threading.Lock()
_count = 0


def _listener(event: str, duration_secs: float, **kwargs) -> None:
    global _count
    if event == _EVENT:
        with _lock:
            _count += 1


monitoring.register_event_duration_secs_listener(_listener)


def num_compilations() -> int:
    """Compilations (jit cache misses) seen in this process so far."""
    return _count
