"""jaxserve's exceptions, at the bottom of the layers: this module imports nothing of the
project, so every layer (the leaf data modules, core, engine, the server) may import it."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine cannot go on (its device state is gone, or recovering from a failed
    step failed): every request in flight is lost and no new one will run. A server
    should exit so that its supervisor restarts it."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its step raised); the engine goes on.

    request_id: the caller's request id; error: what went wrong, the exception's type
    and text (RequestOutput.error).
    """

    def __init__(self, request_id: str, error: str):
        super().__init__(f"request {request_id!r} failed: {error}")
        self.request_id = request_id
        self.error = error


class InputError(ValueError):
    """A request the front door refuses; `param` names the field at fault (OpenAI's
    `param`), so the server never has to guess it from the message."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ConfigError(ValueError):
    """An invalid EngineConfig value; `field` names the knob (a CLI names its flag)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
