"""A pure ASGI middleware that refuses request bodies over a size cap (413).

Pure ASGI on purpose: Starlette's BaseHTTPMiddleware (`@app.middleware("http")`)
hides the client's disconnect from the endpoint, so requests whose client left
were never aborted. This one reads the body itself, up to the cap, and hands it
on; after the body, `receive` is the server's own, so disconnects pass through.
"""
from __future__ import annotations

import json

from jaxserve.api.errors import error_body


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, int(declared))
        chunks, size = [], 0
        while True:   # also catches bodies without a content-length (chunked)
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await self._refuse(send, size)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send, size: int) -> None:
        body = json.dumps(error_body(
            413, f"the request body has {size} bytes or more; this server takes at most "
                 f"{self.max_bytes} (--max-request-body-bytes)")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
