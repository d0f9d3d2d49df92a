"""/v1/models and /reset_prefix_cache (behind --api-key)."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from jaxserve.api.openapi import no_body_responses
from jaxserve.api.routers.deps import Admin

router = APIRouter()


@router.get("/v1/models")
async def models(admin: Admin) -> dict:
    return admin.models()


@router.post("/reset_prefix_cache", response_class=Response,
             responses=no_body_responses("the prefix cache is empty"))
async def reset_prefix_cache(admin: Admin) -> Response:
    """Forgets every cached prompt page (e.g. between benchmark runs); requests in
    flight go on, their pages no longer shared."""
    await admin.reset_prefix_cache()
    return Response(status_code=200)
