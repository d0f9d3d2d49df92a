"""A pure ASGI middleware that checks --api-key before a request's body is read.

As a FastAPI dependency the check ran only after the whole body had been received,
parsed and validated: anyone could make the server do that work without the key.
Here it is the first thing a request to a protected route meets; the open ones
(/health, /metrics, ...: probes and load balancers call them) pass untouched.
"""
from __future__ import annotations

import json
import secrets

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.api.errors import error_body


class APIKey:
    def __init__(self, app: ASGIApp, keys: tuple[str, ...], protected: list[BaseRoute]):
        """keys: any of them opens the protected routes (matched as the router matches
        them: path parameters and --root-path included)."""
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.protected = protected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not any(
                route.matches(scope)[0] is not Match.NONE for route in self.protected):
            return await self.app(scope, receive, send)
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        given = given.strip()
        # Every key is compared, so the time taken does not say which one was close.
        matches = [k for k in self.keys if secrets.compare_digest(given, k)]
        if scheme.lower() == b"bearer" and matches:
            return await self.app(scope, receive, send)
        body = json.dumps(error_body(
            401, "missing or invalid API key (send 'Authorization: Bearer <key>')")).encode()
        # (the body, if any, stays unread: the connection closes after the answer)
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer"),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
