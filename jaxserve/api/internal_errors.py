"""A pure ASGI middleware that turns an unexpected exception into one logged 500.

Starlette's handler for `Exception` answers, then re-raises: uvicorn logs the
traceback a second time and drops the keep-alive connection, so the client's
next request on it fails too. Here the error is logged once, answered in
OpenAI's shape, and the connection lives on.
"""
from __future__ import annotations

import json
import logging
import traceback

from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.api.errors import clip, error_body

logger = logging.getLogger("jaxserve")

# An exception's text may hold a client's value of any size, and a RecursionError has a
# thousand frames: the log gets the text cut and the innermost frames.
_LOGGED_TEXT_CHARS = 2000
_LOGGED_FRAMES = 30


def log_unexpected(what: str, e: BaseException) -> None:
    """Logs an exception nothing expected, bounded in size."""
    frames = "".join(traceback.format_tb(e.__traceback__, limit=-_LOGGED_FRAMES))
    logger.error("%s: %s: %s\n%s", what, type(e).__name__, clip(str(e), _LOGGED_TEXT_CHARS),
                 frames.rstrip())


class InternalErrors:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except BaseException as e:   # noqa: BLE001 - a Rust panic is a BaseException
            # (pyo3's PanicException; each extension has its own class, so by name).
            # Too late for a status once started: let the server close the connection.
            panic = type(e).__name__ == "PanicException"
            if started or not (isinstance(e, Exception) or panic):
                raise
            log_unexpected(f"unhandled error on {scope.get('path')}", e)
            what = "a library panicked (the server log has it)" if panic \
                else f"{type(e).__name__}: {e}"
            body = json.dumps(error_body(500, f"internal error: {what}"))
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body.encode()})
