"""/v1/chat/completions."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jaxserve.api.openapi import generation_responses
from jaxserve.api.protocol import ChatCompletionRequest
from jaxserve.api.routers.deps import Chat

router = APIRouter()


@router.post("/v1/chat/completions", responses=generation_responses())
async def chat(req: ChatCompletionRequest, raw: Request, serving: Chat) -> Response:
    return await serving.create_chat_completion(req, raw)
