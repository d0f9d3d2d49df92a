"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), behind --api-key;
served only when JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING (or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING) is set when the server starts."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from jaxserve.lora_request import MAX_LORA_NAME_CHARS, MAX_LORA_PATH_CHARS

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_LORA_PATH_CHARS)
    base_model_name: str | None = Field(default=None, max_length=MAX_LORA_NAME_CHARS)
    load_inplace: bool = False   # vLLM's: replace an adapter already served under lora_name


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_int_id: int | None = None   # vLLM's field; the name identifies the adapter


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
    """Serves the PEFT adapter at lora_path under lora_name (checked first: 400 naming
    why it cannot be served); load_inplace replaces one already served."""
    serving = raw.app.state.serving
    await serving.loras.load(body.lora_name, body.lora_path, body.base_model_name,
                             serving.engine, body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest,
                              raw: Request) -> PlainTextResponse:
    """Stops serving lora_name (404 when unknown; 400 while a request uses it)."""
    serving = raw.app.state.serving
    await serving.loras.unload(body.lora_name, serving.engine)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
