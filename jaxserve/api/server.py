"""The FastAPI app: routes, API-key check, OpenAI-style errors, metrics."""
from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxserve
from jaxserve.api import openapi
from jaxserve.api.api_key import APIKey
from jaxserve.api.body_limit import BodyLimit
from jaxserve.api.chat_prompt import tokenize_request
from jaxserve.api.errors import APIError, bad_request, error_body, error_response
from jaxserve.api.internal_errors import InternalErrors
from jaxserve.api.metrics import Metrics
from jaxserve.api.openapi import error_responses
from jaxserve.api.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   TokenizeRequest)
from jaxserve.api.serving import OpenAIServing, ServerSettings
from jaxserve.api.stats_logger import StatsLogger
from jaxserve.api.tokenizer_info import tokenizer_info
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError

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
    serving = OpenAIServing(engine, settings, metrics)
    created = int(time.time())

    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} \
        if settings.disable_fastapi_docs else {}
    app = FastAPI(title="jaxserve", version=jaxserve.__version__, **docs)
    app.state.serving = serving
    # Started here, not in a lifespan: the LoadingGate owns the lifespan and this app
    # never sees one (loading.py). The thread ends with the engine.
    app.state.stats_logger = None
    if not settings.disable_log_stats:
        app.state.stats_logger = StatsLogger(engine, settings.log_stats_interval)
        app.state.stats_logger.start()
    openapi.install(app)

    # /health, /ping, /load, /metrics and /version stay open (probes and load balancers
    # call them, as vLLM keeps them); everything under `api` needs the key. The APIKey
    # middleware checks it before the body is read; the dependency only puts the scheme
    # into /openapi.json.
    api = APIRouter(dependencies=[Security(_bearer)] if settings.api_key else [],
                    responses=error_responses(400, 401) if settings.api_key
                    else error_responses(400))
    generation = error_responses(404, 413, 500, 503)
    streamed = {200: {"description": "the answer; with stream=true, server-sent events",
                      "content": {"application/json": {}, "text/event-stream": {}}}}

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, err: RequestValidationError):
        first = _most_specific(err.errors())
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_union_tag(x)]
        if first.get("type") == "json_invalid":
            message, param = "malformed JSON body", None
        elif not loc:   # a whole-body check (e.g. Unicode) names its field itself
            message, param = first.get("msg", "invalid body"), first.get("ctx", {}).get("field")
        else:
            message = f"{'.'.join(loc)}: {first.get('msg', 'invalid value')}"
            param = loc[0]
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, err: StarletteHTTPException):
        # The framework's own 404 / 405 ..., in OpenAI's error shape too.
        return JSONResponse(error_body(err.status_code, str(err.detail)),
                            status_code=err.status_code, headers=err.headers)

    @app.get("/health", response_class=Response,
             responses={200: {"description": "the engine is running (no body)"},
                        **error_responses(503)})
    async def health() -> Response:
        if engine.dead:
            return JSONResponse(error_body(503, "the engine stopped"), status_code=503)
        return Response(status_code=200)

    # SageMaker's health check, by GET or POST: /health's answer.
    for method in ("GET", "POST"):
        app.add_api_route("/ping", health, methods=[method], name=f"ping_{method.lower()}",
                          response_class=Response, responses={
                              200: {"description": "the engine is running (no body)"},
                              **error_responses(503)})

    @app.get("/load")
    async def load() -> dict:
        """Generation requests in flight (admitted, not yet answered), for load balancers."""
        return {"server_load": serving.num_requests}

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus() -> Response:
        inputs = engine.inputs
        return Response(metrics.render(engine.stats, admitted=serving.num_in_flight,
                                       processed=inputs.num_processed,
                                       refused=inputs.num_refused),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": jaxserve.__version__}

    @api.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created,
            "owned_by": "jaxserve", "root": engine.config.model,
            "max_model_len": settings.max_model_len} for name in settings.served_model_names]}

    @api.post("/reset_prefix_cache", response_class=Response,
              responses={200: {"description": "the prefix cache is empty (no body)"},
                         **error_responses(503)})
    async def reset_prefix_cache() -> Response:
        """Forgets every cached prompt page (e.g. between benchmark runs); requests in
        flight go on, their pages no longer shared."""
        try:
            await engine.reset_prefix_cache()
        except EngineDeadError as e:
            raise APIError(503, f"the engine stopped: {e}") from None
        return Response(status_code=200)

    if settings.enable_tokenizer_info_endpoint:
        @api.get("/tokenizer_info")
        async def get_tokenizer_info() -> dict:
            """The tokenizer's configuration (vLLM's shape), the chat template included."""
            if engine.tokenizer is None:
                raise APIError(400, "this model has no tokenizer")
            return tokenizer_info(engine.tokenizer, chat_template=settings.chat_template,
                                  max_model_len=settings.max_model_len)

    @api.post("/v1/completions", responses={**streamed, **generation})
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @api.post("/v1/chat/completions", responses={**streamed, **generation})
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @api.post("/tokenize", responses=error_responses(404, 413))
    async def tokenize(req: TokenizeRequest) -> dict:
        serving.check_model(req.model)
        try:
            ids = await asyncio.to_thread(tokenize_request, engine.inputs, req,
                                          chat_template=settings.chat_template,
                                          template_kwargs=serving.template_kwargs(req))
        except ValueError as e:
            raise bad_request(e)
        out = {"count": len(ids), "max_model_len": settings.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
        return out

    @api.post("/detokenize", responses=error_responses(404, 413))
    async def detokenize(req: DetokenizeRequest) -> dict:
        serving.check_model(req.model)
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        vocab = engine.info.vocab_size
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                           "tokens")
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, req.tokens)}

    app.include_router(api)
    # Outermost last: InternalErrors (whatever goes wrong below is one 500), then the
    # key, then the body's bounds, all before FastAPI parses anything.
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKey, keys=settings.api_key, protected=list(api.routes))
    app.add_middleware(InternalErrors)
    return app


def _most_specific(errors: list[dict]) -> dict:
    """A value that fits no branch of a union (prompt: str | list[int] | ...) gets an
    error per branch; the one that is not a mere type mismatch says what is wrong."""
    specific = [e for e in errors if not e.get("type", "").endswith("_type")]
    return (specific or errors or [{}])[0]


_BUILTIN_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_union_tag(part) -> bool:
    """pydantic names the union branch in an error's location ('list[constrained-int]')."""
    return isinstance(part, str) and ("[" in part or "-" in part or part in _BUILTIN_TAGS)
