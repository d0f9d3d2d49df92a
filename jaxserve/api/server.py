"""The FastAPI app: each endpoint family's router (api/routers/) over its serving object
(api/serving/), OpenAI-style errors (error_handlers.py), and the ASGI middlewares that
run before FastAPI parses anything (API key, body bounds, one 500 for the unexpected)."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Security
from fastapi.security import HTTPBearer

import jaxserve
from jaxserve.api import error_handlers, openapi
from jaxserve.api.api_key import APIKey
from jaxserve.api.body_limit import BodyLimit
from jaxserve.api.internal_errors import InternalErrors
from jaxserve.api.lora_adapters import runtime_updates_allowed
from jaxserve.api.metrics import Metrics
from jaxserve.api.openapi import error_responses
from jaxserve.api.routers import admin, chat, completions, deps, lora, probes, tokenize
from jaxserve.api.serving.base import OpenAIServing
from jaxserve.api.settings import ServerSettings
from jaxserve.api.stats_logger import StatsLogger
from jaxserve.engine.async_engine import AsyncEngine

# (documents the scheme only: api_key.APIKey checks the key)
_bearer = HTTPBearer(auto_error=False, description="--api-key, as 'Authorization: Bearer KEY'")


def create_app(engine: AsyncEngine, settings: ServerSettings,
               metrics: Metrics | None = None) -> FastAPI:
    """The app serving `engine`; whoever made the engine stops it (see loading.py).
    metrics: the server's registry when it already has one (it answered /metrics while
    the engine loaded)."""
    # (the CLI's registry has the speculative counters from the start; this one adds them
    # at the first statistics that carry any)
    metrics = metrics or Metrics(settings.served_model_name)
    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} \
        if settings.disable_fastapi_docs else {}
    app = FastAPI(title="jaxserve", version=jaxserve.__version__, **docs)
    deps.install(app, OpenAIServing(engine, settings, metrics))
    # Started here, not in a lifespan: the LoadingGate owns the lifespan and this app
    # never sees one (loading.py). The thread ends with the engine.
    app.state.stats_logger = None
    if not settings.disable_log_stats:
        app.state.stats_logger = StatsLogger(engine, settings.log_stats_interval)
        app.state.stats_logger.start()
    openapi.install(app)
    error_handlers.install(app)

    # The probes stay open; every other route needs the key. The APIKey middleware
    # checks it before the body is read; the dependency only puts the scheme into
    # /openapi.json.
    app.include_router(probes.router)
    keyed = _keyed_routers(settings)
    for router in keyed:
        app.include_router(router, dependencies=[Security(_bearer)] if settings.api_key else [],
                           responses=error_responses(400, 401) if settings.api_key
                           else error_responses(400))
    # Outermost last: InternalErrors (whatever goes wrong below is one 500), then the
    # key, then the body's bounds, all before FastAPI parses anything.
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKey, keys=settings.api_key,
                           protected=[route for router in keyed for route in router.routes])
    app.add_middleware(InternalErrors)
    return app


def _keyed_routers(settings: ServerSettings) -> list[APIRouter]:
    """The routers behind --api-key (/tokenizer_info only when it is enabled, the LoRA
    load / unload endpoints only with runtime updates allowed, as vLLM)."""
    info = [tokenize.info_router] if settings.enable_tokenizer_info_endpoint else []
    loras = [lora.router] if runtime_updates_allowed() else []
    return [admin.router, *info, *loras, completions.router, chat.router, tokenize.router]
