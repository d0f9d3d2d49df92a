"""The FastAPI app: routes, API-key check, OpenAI-style errors, metrics."""
from __future__ import annotations

import logging
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import jaxserve
from jaxserve.api.errors import APIError, error_body, error_response
from jaxserve.api.metrics import Metrics
from jaxserve.api.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   TokenizeRequest)
from jaxserve.api.serving import OpenAIServing, ServerSettings
from jaxserve.chat import render_chat
from jaxserve.engine.async_engine import AsyncEngine

logger = logging.getLogger("jaxserve")

_OPEN_PATHS = ("/health", "/metrics", "/version")


def create_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    metrics = Metrics(settings.served_model_name)
    serving = OpenAIServing(engine, settings, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        logger.info("shutting down: aborting requests in flight and stopping the engine")
        engine.shutdown()

    app = FastAPI(title="jaxserve", version=jaxserve.__version__, lifespan=lifespan)
    app.state.serving = serving

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if settings.api_key and request.url.path not in _OPEN_PATHS:
            auth = request.headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(given.encode(), settings.api_key.encode()):
                return error_response(APIError(401, "missing or invalid API key "
                                                    "(send 'Authorization: Bearer <key>')"))
        return await call_next(request)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message, param = "malformed JSON body", None
        else:
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
            param = loc[0] if loc else None
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, err: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {err}"), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if engine.dead:
            return JSONResponse(error_body(500, "the engine stopped"), status_code=500)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(engine.stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": jaxserve.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": settings.served_model_name, "object": "model", "created": created,
            "owned_by": "jaxserve", "root": engine.config.model,
            "max_model_len": settings.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    def tokenizer_for(model: str | None):
        serving.check_model(model)
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return engine.tokenizer

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        tok = tokenizer_for(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
        if req.prompt is not None:
            ids = tok(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
        else:
            try:
                ids = render_chat(tok, [m.model_dump() for m in req.messages],
                                  chat_template=settings.chat_template,
                                  add_generation_prompt=req.add_generation_prompt)
            except ValueError as e:
                raise APIError(400, str(e), "messages")
        return {"tokens": list(ids), "count": len(ids), "max_model_len": settings.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        tok = tokenizer_for(req.model)
        vocab = engine.core.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                           "tokens")
        return {"prompt": tok.decode(req.tokens)}

    return app
