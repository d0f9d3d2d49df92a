"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}}.

Every error a client sees is built here (error_body), so here its size is bounded: a
message quotes at most MAX_ERROR_MESSAGE_CHARS characters (the offending value it
names may be megabytes), and never a native library's panic or any backtrace, which
go to the server log instead.
"""
from __future__ import annotations

import logging
import re

from fastapi.responses import JSONResponse

logger = logging.getLogger("jaxserve")

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowedError", 413: "RequestTooLargeError",
          500: "InternalServerError", 503: "ServiceUnavailableError"}
# Enough to name the problem and show the start of the value; the rest is cut.
MAX_ERROR_MESSAGE_CHARS = 1000
MAX_ERROR_PARAM_CHARS = 200
# Where a Rust panic (llguidance's "panic: ...", pyo3's "panicked at") or a backtrace
# starts inside an error's text.
_INTERNALS = re.compile(r"\bpanic: |\bpanicked at\b|stack backtrace:|"
                        r"Traceback \(most recent call last\)")
_LOGGED_CHARS = 4000   # of a panic's text, for the operator


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def clip(text: str, limit: int) -> str:
    """text, cut to at most `limit` characters (saying how long it was) when longer."""
    if len(text) <= limit:
        return text
    tail = f"... ({len(text)} characters)"
    return text[:max(limit - len(tail), 0)] + tail


def client_message(message: str) -> str:
    """What a client may see of an error's text: bounded, without panics or backtraces."""
    internals = _INTERNALS.search(message)
    if internals:
        logger.warning("error text with a panic or backtrace, not shown to the client: %s",
                       clip(message, _LOGGED_CHARS))
        message = (message[:internals.start()].rstrip(" :(\n") +
                   " (an internal error of the server's libraries; the server log has it)")
    return clip(message, MAX_ERROR_MESSAGE_CHARS)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    if param is not None:
        param = clip(str(param), MAX_ERROR_PARAM_CHARS)
    return {"error": {"message": client_message(str(message)),
                      "type": _TYPES.get(status, "APIError"), "param": param, "code": status}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param), status_code=err.status,
                        headers=err.headers)


def bad_request(e: ValueError, param: str | None = None) -> APIError:
    """A refused request: an InputError (from the input processor or SamplingParams)
    names its field; `param` is the fallback for one that names none."""
    return APIError(400, str(e), getattr(e, "param", None) or param)
