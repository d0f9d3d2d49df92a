"""The server's own endpoints: probes (/health, /ping, /load, /metrics, /version: open,
as vLLM keeps them, for probes and load balancers) and administration (/v1/models,
/reset_prefix_cache: behind --api-key)."""
from __future__ import annotations

import jaxserve
from jaxserve.api.errors import APIError
from jaxserve.api.serving.base import OpenAIServing
from jaxserve.engine.async_engine import EngineDeadError


class AdminServing:
    def __init__(self, base: OpenAIServing):
        self.base = base

    def is_healthy(self) -> bool:
        """The engine is running."""
        return not self.base.engine.dead

    def load(self) -> dict:
        """Generation requests in flight (admitted, not yet answered), for load balancers."""
        return {"server_load": self.base.num_requests}

    def metrics_text(self) -> bytes:
        """/metrics: Prometheus text, from the engine's latest statistics."""
        base = self.base
        inputs = base.engine.inputs
        return base.metrics.render(base.engine.stats, admitted=base.num_in_flight,
                                   processed=inputs.num_processed, refused=inputs.num_refused)

    @staticmethod
    def version() -> dict:
        return {"version": jaxserve.__version__}

    def models(self) -> dict:
        """The served names (each an alias of the one model), then the LoRA adapters
        (parent: the model they adapt), OpenAI's model list."""
        base = self.base
        settings = base.settings
        card = {"object": "model", "created": base.created, "owned_by": "jaxserve",
                "max_model_len": settings.max_model_len}
        models = [{"id": name, **card, "root": base.engine.config.model}
                  for name in settings.served_model_names]
        models += [{"id": name, **card, "root": a.lora_path,
                    "parent": a.base_model_name or settings.served_model_name}
                   for name, a in base.loras.by_name.items()]
        return {"object": "list", "data": models}

    async def reset_prefix_cache(self) -> None:
        """Forgets every cached prompt page; requests in flight go on, their pages no
        longer shared."""
        try:
            await self.base.engine.reset_prefix_cache()
        except EngineDeadError as e:
            raise APIError(503, f"the engine stopped: {e}") from None
