"""/v1/completions."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jaxserve.api.openapi import generation_responses
from jaxserve.api.protocol import CompletionRequest
from jaxserve.api.routers.deps import Completions

router = APIRouter()


@router.post("/v1/completions", responses=generation_responses())
async def completions(req: CompletionRequest, raw: Request, serving: Completions) -> Response:
    return await serving.create_completion(req, raw)
