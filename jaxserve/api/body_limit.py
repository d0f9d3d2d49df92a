"""A pure ASGI middleware that refuses outsized request bodies while reading them: over
the byte cap (413), or JSON with too many values or object fields (413) or nested too
deep (400), measured on the raw bytes (json_limits.JsonShape) before anything parses
them. The cost of parsing grows with values, not bytes: 30 MB of small ints took the
event loop (and every /health answer) 10 s in json, pydantic and the walks after.

Pure ASGI on purpose: Starlette's BaseHTTPMiddleware (`@app.middleware("http")`)
hides the client's disconnect from the endpoint, so requests whose client left
were never aborted. This one reads the body itself, up to the cap, and hands it
on; after the body, `receive` is the server's own, so disconnects pass through.
"""
from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.api.errors import error_body
from jaxserve.json_limits import MAX_JSON_DEPTH, JsonShape

# A request needs about one value per prompt token (prompts given as token ids, a
# /detokenize list): 2**20 holds a full prompt of a 1M-token context, and parses (json,
# then pydantic) in a fraction of a second.
MAX_BODY_JSON_VALUES = 2**20
# Object fields in the whole body: messages, tools and their schemas, logit_bias (128
# at most) come to a few thousand in a large request.
MAX_BODY_JSON_FIELDS = 2**16


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, 413, self._too_big(int(declared)))
        chunks, size, shape = [], 0, JsonShape()
        while True:   # also catches bodies without a content-length (chunked)
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await self._refuse(send, 413, self._too_big(size))
            shape.feed(body)
            refusal = _outsized(shape)
            if refusal:
                return await self._refuse(send, *refusal)
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

    def _too_big(self, size: int) -> str:
        return (f"the request body has {size} bytes or more; this server takes at most "
                f"{self.max_bytes} (--max-request-body-bytes)")

    async def _refuse(self, send, status: int, message: str) -> None:
        body = json.dumps(error_body(status, message)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _outsized(shape: JsonShape) -> tuple[int, str] | None:
    """(status, message) when the body read so far is already past a bound."""
    if shape.max_depth > MAX_JSON_DEPTH:
        return 400, (f"the request body's JSON is nested more than {MAX_JSON_DEPTH} levels "
                     f"deep; this server takes at most {MAX_JSON_DEPTH} (MAX_JSON_DEPTH)")
    if shape.values > MAX_BODY_JSON_VALUES:
        return 413, (f"the request body has more than {MAX_BODY_JSON_VALUES} JSON values "
                     f"(array elements and object fields); this server takes at most "
                     f"{MAX_BODY_JSON_VALUES} (MAX_BODY_JSON_VALUES)")
    if shape.fields > MAX_BODY_JSON_FIELDS:
        return 413, (f"the request body has more than {MAX_BODY_JSON_FIELDS} JSON object "
                     f"fields; this server takes at most {MAX_BODY_JSON_FIELDS} "
                     f"(MAX_BODY_JSON_FIELDS)")
    return None
