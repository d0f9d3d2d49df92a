"""Old home of the exceptions (now `jaxserve.errors`, importable from every layer)."""
from __future__ import annotations

from jaxserve.errors import EngineDeadError, InputError, RequestFailedError

__all__ = ["EngineDeadError", "InputError", "RequestFailedError"]
