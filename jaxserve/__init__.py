"""jaxserve: a pure-JAX/XLA serving engine for large language models.

Imports are lazy so that `jaxserve.core` (host-only) never pulls in jax.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jaxserve.engine.llm",
    "SamplingParams": "jaxserve.sampling_params",
    "RequestOutput": "jaxserve.core.outputs",
    "CompletionOutput": "jaxserve.core.outputs",
    "EngineConfig": "jaxserve.config",
    "StructuredOutputsParams": "jaxserve.structured_outputs",
    "RequestOutputKind": "jaxserve.sampling_params",
    "TextPrompt": "jaxserve.inputs",
    "TokensPrompt": "jaxserve.inputs",
    "LoRARequest": "jaxserve.lora_request",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
