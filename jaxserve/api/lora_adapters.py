"""The server's LoRA adapters by name: those of --lora-modules, and those loaded at
runtime (POST /v1/load_lora_adapter, only with JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING or
vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING set). A request's `model` names the base model
(a served name) or an adapter; anything else is a 404 naming it."""
from __future__ import annotations

import asyncio
import os
from typing import Any

from jaxserve.api.errors import APIError
from jaxserve.errors import EngineDeadError
from jaxserve.lora_request import LoRARequest

RUNTIME_UPDATES_ENV = ("JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updates_allowed(environ: Any = os.environ) -> bool:
    """Whether the load / unload endpoints are served: one of the two variables is
    1 / true / yes (vLLM's switch, under either name)."""
    return any(environ.get(name, "").strip().lower() in ("1", "true", "yes")
               for name in RUNTIME_UPDATES_ENV)


class LoRAAdapters:
    """name -> LoRARequest. enabled: the engine serves LoRA (--enable-lora); inputs: its
    input processor (checked_lora: the 400 reasons of an adapter it cannot serve)."""

    def __init__(self, modules: tuple[LoRARequest, ...], enabled: bool, inputs: Any):
        self.enabled = enabled
        self.inputs = inputs
        self.by_name: dict[str, LoRARequest] = {m.lora_name: m for m in modules}
        self._next_id = max((m.lora_int_id for m in modules), default=0) + 1
        self._lock = asyncio.Lock()   # one load / unload at a time
        self._retiring: set[asyncio.Task] = set()   # replaced versions awaiting their users

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.by_name.get(name)

    async def load(self, name: str, path: str, base_model_name: str | None, engine: Any,
                   load_inplace: bool = False) -> None:
        """Checks the adapter (read, fitted to the model) off the event loop, then serves
        it under `name`: 400 naming why not. A name already served is a 400 unless
        load_inplace (vLLM's field): then the new files replace it under a new id, so no
        prefix-cache page of the old version is reused; requests already running keep
        the version they started with, which is unloaded once the last of them ends."""
        if not self.enabled:
            raise APIError(400, "LoRA is off: start the server with --enable-lora", "lora_name")
        async with self._lock:
            old = self.by_name.get(name)
            if old is not None and not load_inplace:
                raise APIError(400, f"The lora adapter '{name}' has already been loaded; "
                                    f"send load_inplace: true to replace it.", "lora_name")
            try:
                req = LoRARequest(name, self._next_id, path, base_model_name)
                await asyncio.to_thread(self.inputs.checked_lora, req)
            except ValueError as e:
                raise APIError(400, str(e), "lora_path") from None
            self._next_id += 1
            self.by_name[name] = req
            if old is not None:
                task = asyncio.create_task(self._retire(old, engine))
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)

    @staticmethod
    async def _retire(old: LoRARequest, engine: Any, poll_s: float = 0.25) -> None:
        """Unloads a replaced version as soon as no request uses it (the engine refuses
        while one does: ValueError); gives up if the engine stops."""
        while True:
            try:
                await engine.remove_lora(old.lora_int_id)
                return
            except ValueError:
                await asyncio.sleep(poll_s)
            except EngineDeadError:   # stopped or stopping: nothing left to unload
                return

    async def unload(self, name: str, engine: Any) -> None:
        """Stops serving `name`: 404 when unknown, 400 while a request uses it."""
        async with self._lock:
            req = self.by_name.get(name)
            if req is None:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
            try:
                await engine.remove_lora(req.lora_int_id)
            except ValueError as e:
                raise APIError(400, str(e), "lora_name") from None
            del self.by_name[name]
