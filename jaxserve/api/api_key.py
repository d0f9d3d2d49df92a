"""A pure ASGI middleware that checks --api-key before a request's body is read.

As a FastAPI dependency the check ran only after the whole body had been received,
parsed and validated: anyone could make the server do that work without the key.
Here it is the first thing a request to a protected route meets; the open ones
(/health, /metrics, ...: probes and load balancers call them) pass untouched.
"""
from __future__ import annotations

import json
import secrets

from jaxserve.api.errors import error_body


class APIKey:
    def __init__(self, app, key: str, protected: frozenset[str]):
        """protected: the routes' paths (as the router matches them) that need the key."""
        self.app = app
        self.key = key.encode()
        self.protected = protected

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or _route_path(scope) not in self.protected:
            return await self.app(scope, receive, send)
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(given.strip(), self.key):
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


def _route_path(scope) -> str:
    """The path the router matches: without the --root-path prefix when the request
    carries it (a proxy that does not strip it)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        return path[len(root):]
    return path
