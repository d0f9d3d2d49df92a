"""The LoRA settings' checks and vLLM's --lora-modules forms (EngineConfig's fields
enable_lora, lora_modules, max_loras, max_lora_rank, max_cpu_loras, lora_dtype)."""
from __future__ import annotations

import json
from typing import Any, Callable

from jaxserve.errors import ConfigError
from jaxserve.lora_request import LoRARequest
from models.config import SERVING_DTYPES

LORA_DTYPES = ("auto", *SERVING_DTYPES)
_JSON_KEYS = {"name", "path", "base_model_name"}


def _module(item: Any) -> tuple[str, str, str | None]:
    """One --lora-modules item -> (name, path, base model name). Forms: "name=path",
    vLLM's JSON '{"name": ..., "path": ..., "base_model_name": ...}' (text or a dict),
    or a LoRARequest."""
    if isinstance(item, LoRARequest):
        return item.lora_name, item.lora_path, item.base_model_name
    if isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            item = json.loads(item)
        except json.JSONDecodeError:
            raise ValueError(f"{item[:200]!r} is not JSON") from None
    if isinstance(item, dict):
        extra = set(item) - _JSON_KEYS
        if extra or not isinstance(item.get("name"), str) or not isinstance(item.get("path"), str):
            raise ValueError(f"{json.dumps(item)[:200]} must have string keys 'name' and "
                             f"'path' (and optionally 'base_model_name'), nothing else")
        base = item.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"{item['name'][:100]!r}: base_model_name must be a string")
        return item["name"], item["path"], base
    if isinstance(item, str) and "=" in item:
        name, path = item.split("=", 1)
        return name, path, None
    raise ValueError(f"{str(item)[:200]!r} is not name=path or vLLM's JSON form "
                     f"'{{\"name\": ..., \"path\": ...}}'")


def parse_lora_modules(value: Any) -> tuple[LoRARequest, ...]:
    """--lora-modules' items as LoRARequests, lora_int_id 1, 2, ... in the order given
    (names unique). ValueError naming the item at fault."""
    if value is None:
        return ()
    if isinstance(value, (str, dict, LoRARequest)):
        value = [value]
    out: list[LoRARequest] = []
    for item in value:
        name, path, base = _module(item)
        if any(m.lora_name == name for m in out):
            raise ValueError(f"adapter name {name[:100]!r} is given twice")
        out.append(LoRARequest(name, len(out) + 1, path, base))
    return tuple(out)


def check_lora_settings(config: Any, bad: Callable[[str, str], ConfigError]) -> None:
    """EngineConfig's LoRA fields: positive sizes, a known dtype, modules parsed (set
    back as LoRARequests) and only with enable_lora."""
    try:
        modules = parse_lora_modules(config.lora_modules)
    except ValueError as e:
        raise ConfigError("lora_modules", f"lora_modules: {e}") from None
    object.__setattr__(config, "lora_modules", modules)
    for name in ("max_loras", "max_lora_rank"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(name, "must be an int >= 1")
    cpu = config.max_cpu_loras
    if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int)
                            or cpu < config.max_loras):
        raise bad("max_cpu_loras", f"must be an int >= max_loras ({config.max_loras}): the "
                  f"adapters on the device are also kept on the host")
    if config.lora_dtype not in LORA_DTYPES:
        raise bad("lora_dtype", f"must be one of {LORA_DTYPES}")
    if modules and not config.enable_lora:
        raise ConfigError("lora_modules", "lora_modules: adapters are served only with "
                          "--enable-lora (LLM(enable_lora=True))")
