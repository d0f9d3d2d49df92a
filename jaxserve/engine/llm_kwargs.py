"""LLM(...)'s keyword arguments -> EngineConfig's.

LLM takes EngineConfig's fields, the keyword form of their vLLM flag aliases
(`block_size=` for --block-size, `gpu_memory_utilization=` for
--gpu-memory-utilization: read from the fields' metadata, so they cannot drift), and
vLLM's other engine arguments where their value is true of jaxserve (VLLM_ONLY: the
command line's table, jaxserve/config/vllm_compat.py, and LLM's own). Anything else is a
TypeError naming it, with the close names it may have meant.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.config.vllm_compat import BOOL, ENGINE, Setting

_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def _keyword_aliases() -> dict[str, str]:
    """The keyword form of every long flag alias -> its field (block_size -> page_size).
    Short aliases (-tp, -q) have no keyword form: vLLM's LLM has none either."""
    out = {}
    for name, f in _FIELDS.items():
        for alias in f.metadata.get("aliases", ()):
            if alias.startswith("--"):
                out[alias[2:].replace("-", "_")] = name
    return out


ALIASES: dict[str, str] = _keyword_aliases()

# vLLM LLM arguments with no jaxserve knob: the engine flags' (vllm_compat.ENGINE) and
# LLM's own, where LLM differs from the server.
VLLM_ONLY: dict[str, Setting] = {
    **ENGINE,
    "disable_log_stats": Setting(BOOL, (True,), "LLM logs no periodic statistics (vLLM's "
                                 "LLM defaults to True as well); the server's /metrics has "
                                 "them"),
}

# EngineConfig fields only the server reads: LLM refuses them rather than ignore them.
SERVER_ONLY: dict[str, str] = {
    "lora_modules": "adapters named for the server's `model` field (--lora-modules); "
                    "offline, pass lora_request=LoRARequest(name, int_id, path) to "
                    "generate() or chat()",
}


def engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """LLM's keyword arguments as EngineConfig keyword arguments. TypeError for a name
    LLM does not take, ValueError for a value it cannot honour (each names the
    argument)."""
    hints = typing.get_type_hints(EngineConfig)
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for name, value in kwargs.items():
        if name in VLLM_ONLY:
            setting = VLLM_ONLY[name]
            if not setting.holds(value):
                raise ValueError(f"LLM({name}={value!r}) is not supported by jaxserve: "
                                 f"{setting.why} (it takes {setting.accepted_text()})")
            continue
        if name in SERVER_ONLY and value:
            raise ValueError(f"LLM({name}=...) is not taken offline: {SERVER_ONLY[name]}")
        field = ALIASES.get(name, name)
        if field not in _FIELDS or field == "model":
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}"
                            f"{_suggestion(name)}")
        if field in given_as:
            raise TypeError(f"LLM() got both {given_as[field]!r} and {name!r}, which name "
                            f"the same setting; give one")
        if value is None and type(None) not in typing.get_args(hints[field]):
            default = _FIELDS[field].default
            raise ValueError(f"LLM({name}=None): {name} takes a value (default "
                             f"{default!r}); leave it out for the default")
        given_as[field] = name
        out[field] = value
    return out


def engine_config(model: str, kwargs: dict[str, Any]) -> EngineConfig:
    """LLM's EngineConfig; a bad value's ConfigError names the keyword it was given as
    (num_gpu_blocks_override=, not the field num_pages)."""
    fields = engine_kwargs(kwargs)
    try:
        return EngineConfig(model=model, **fields)
    except ConfigError as e:
        given = next((k for k in kwargs if ALIASES.get(k) == e.field and k != e.field), None)
        if given is None:
            raise
        raise ConfigError(e.field, f"LLM({given}=...): {e}") from None


def _suggestion(name: str) -> str:
    known = [n for n in (*_FIELDS, *ALIASES, *VLLM_ONLY) if n != "model"]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
