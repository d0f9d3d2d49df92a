"""What /openapi.json says the server answers: OpenAI-shaped errors, never 422.

FastAPI documents a 422 with its own error shape on every route with a body;
this server answers invalid bodies with 400 and OpenAI's {"error": {...}}.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route that can answer these error codes."""
    why = {400: "invalid request", 401: "missing or wrong API key",
           404: "unknown model", 413: "request body too large",
           500: "the engine failed on this request",
           503: "overloaded, shutting down, or the engine stopped"}
    return {c: {"model": ErrorResponse, "description": why[c]} for c in codes}


def generation_responses() -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route that generates: JSON, or server-sent events."""
    return {200: {"description": "the answer; with stream=true, server-sent events",
                  "content": {"application/json": {}, "text/event-stream": {}}},
            **error_responses(404, 413, 500, 503)}


def no_body_responses(what: str) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route whose 200 has no body (`what` it means), or a 503."""
    return {200: {"description": f"{what} (no body)"}, **error_responses(503)}


def install(app: FastAPI) -> None:
    """Replaces app.openapi with one whose routes list 400 in place of 422."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
