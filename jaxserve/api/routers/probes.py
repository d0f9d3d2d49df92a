"""/health, /ping, /load, /metrics, /version: open, without --api-key (probes and load
balancers call them, as vLLM keeps them)."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from jaxserve.api.errors import error_body
from jaxserve.api.openapi import no_body_responses
from jaxserve.api.routers.deps import Admin

router = APIRouter()


@router.get("/health", response_class=Response,
            responses=no_body_responses("the engine is running"))
async def health(admin: Admin) -> Response:
    if not admin.is_healthy():
        return JSONResponse(error_body(503, "the engine stopped"), status_code=503)
    return Response(status_code=200)


# SageMaker's health check, by GET or POST: /health's answer.
for _method in ("GET", "POST"):
    router.add_api_route("/ping", health, methods=[_method], name=f"ping_{_method.lower()}",
                         response_class=Response,
                         responses=no_body_responses("the engine is running"))


@router.get("/load")
async def load(admin: Admin) -> dict:
    """Generation requests in flight (admitted, not yet answered), for load balancers."""
    return admin.load()


@router.get("/metrics", response_class=Response, responses={200: {
    "description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {}}}})
async def prometheus(admin: Admin) -> Response:
    return Response(admin.metrics_text(), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version(admin: Admin) -> dict:
    return admin.version()
