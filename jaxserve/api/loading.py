"""LoadingGate: the ASGI app uvicorn serves from its first second, while the engine is
still being built in another thread.

Until `open` hands it the real app (create_app's), /health (and /ping) answers 503 with the
engine's StartupProgress (phase, detail, seconds), /metrics and /version answer as
usual, and everything else 503 in OpenAI's error shape. From then on every request
goes to the real app. The gate, not the real app, owns the lifespan: it stops the
engine when the server shuts down (the real app never sees a lifespan of its own).

Imports nothing heavy (no jax), so the port opens before the engine's modules load.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.api.errors import error_body
from jaxserve.api.metrics import Metrics
from jaxserve.build.startup import FAILED, StartupProgress

if TYPE_CHECKING:   # (not at run time: the port opens before the engine's modules load)
    from jaxserve.api.serving.base import OpenAIServing
    from jaxserve.engine.async_engine import AsyncEngine

logger = logging.getLogger("jaxserve")

# A client told to come back later: the engine's phases take seconds at least.
_RETRY_AFTER_S = "5"


class LoadingGate:
    def __init__(self, progress: StartupProgress, metrics: Metrics, version: str):
        self.progress = progress
        self.metrics = metrics
        self.version = version
        self.app: Any = None        # the real ASGI app, once the engine is built
        self.engine: Any = None     # the AsyncEngine, stopped on shutdown
        self._closed = False
        self._lock = threading.Lock()

    # ---- the thread that builds the engine -----------------------------------------------
    def open(self, app: ASGIApp, engine: AsyncEngine) -> None:
        """The engine is built: requests go to `app` from now on."""
        with self._lock:
            closed = self._closed
            self.engine = engine
            self.app = app        # last: a request that sees the app sees the engine
        if closed:   # the server stopped while the engine was being built
            engine.shutdown()

    def fail(self, error: BaseException) -> None:
        self.progress.set_phase(FAILED, f"{type(error).__name__}: {error}")

    @property
    def serving(self) -> OpenAIServing | None:
        """The real app's OpenAIServing, or None while loading."""
        app = self.app
        return None if app is None else app.state.serving

    # ---- ASGI --------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        app = self.app
        if app is not None:
            await app(scope, receive, send)
            return
        if scope["type"] != "http":   # websockets: nothing is served over them
            await send({"type": "websocket.close", "code": 1013})
            return
        await self._while_loading(scope["path"])(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                with self._lock:
                    self._closed = True
                    engine = self.engine
                if engine is not None:
                    logger.info("shutting down: aborting requests in flight and stopping "
                                "the engine")
                    engine.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _while_loading(self, path: str) -> Response:
        snap = self.progress.snapshot()
        if path in ("/health", "/ping"):   # /ping: SageMaker's /health
            status = "failed" if snap.phase == FAILED else "loading"
            return JSONResponse({"status": status, **snap.as_dict()}, status_code=503,
                                headers={"Retry-After": _RETRY_AFTER_S})
        if path == "/metrics":
            return Response(self.metrics.render_idle(), media_type=CONTENT_TYPE_LATEST)
        if path == "/version":
            return JSONResponse({"version": self.version})
        if snap.phase == FAILED:
            message = f"the engine failed to start ({snap.detail}); the server is exiting"
        else:
            what = f"{snap.phase}: {snap.detail}" if snap.detail else snap.phase
            message = (f"the model is still loading ({what}; {snap.seconds:.0f} s so far); "
                       f"retry when GET /health answers 200")
        return JSONResponse(error_body(503, message), status_code=503,
                            headers={"Retry-After": _RETRY_AFTER_S})
