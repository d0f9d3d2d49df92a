"""/tokenize and /detokenize; /tokenizer_info (its own router: only with
--enable-tokenizer-info-endpoint). All behind --api-key."""
from __future__ import annotations

from fastapi import APIRouter

from jaxserve.api.openapi import error_responses
from jaxserve.api.protocol import DetokenizeRequest, TokenizeRequest
from jaxserve.api.routers.deps import Tokenize

router = APIRouter()
info_router = APIRouter()


@info_router.get("/tokenizer_info")
async def get_tokenizer_info(serving: Tokenize) -> dict:
    """The tokenizer's configuration (vLLM's shape), the chat template included."""
    return serving.tokenizer_info()


@router.post("/tokenize", responses=error_responses(404, 413))
async def tokenize(req: TokenizeRequest, serving: Tokenize) -> dict:
    return await serving.tokenize(req)


@router.post("/detokenize", responses=error_responses(404, 413))
async def detokenize(req: DetokenizeRequest, serving: Tokenize) -> dict:
    return await serving.detokenize(req)
