"""A pure ASGI middleware that turns an unexpected exception into one logged 500.

Starlette's handler for `Exception` answers, then re-raises: uvicorn logs the
traceback a second time and drops the keep-alive connection, so the client's
next request on it fails too. Here the error is logged once, answered in
OpenAI's shape, and the connection lives on.
"""
from __future__ import annotations

import json
import logging

from jaxserve.api.errors import error_body

logger = logging.getLogger("jaxserve")


class InternalErrors:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            if started:   # too late for a status: let the server close the connection
                raise
            logger.exception("unhandled error on %s", scope.get("path"))
            body = json.dumps(error_body(500, f"internal error: {type(e).__name__}: {e}"))
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body.encode()})
