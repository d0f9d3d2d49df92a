"""LLM(...)'s keyword arguments -> EngineConfig's.

LLM takes EngineConfig's fields, the keyword form of their vLLM flag aliases
(`block_size=` for --block-size, `gpu_memory_utilization=` for
--gpu-memory-utilization: read from the fields' metadata, so they cannot drift), and
vLLM's LLM-only arguments where their value is true of jaxserve (VLLM_ONLY). Anything
else is a TypeError naming it, with the close names it may have meant.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Callable

from jaxserve.config import EngineConfig

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

# vLLM LLM arguments with no jaxserve knob: (is the value one that is true of jaxserve,
# what jaxserve does instead). Any other value is refused with the reason.
VLLM_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "disable_log_stats": (lambda v: v is True, "LLM logs no periodic statistics (vLLM's "
                          "LLM defaults to True as well); the server's /metrics has them"),
    "tokenizer_mode": (lambda v: v == "auto", "the tokenizer is the checkpoint's Hugging "
                       "Face AutoTokenizer ('auto' only)"),
    "skip_tokenizer_init": (lambda v: v is False, "the checkpoint's tokenizer is always "
                            "loaded when it has one"),
    "cpu_offload_gb": (lambda v: v == 0, "weights are never offloaded to host memory"),
    "disable_custom_all_reduce": (lambda v: v is True, "jaxserve has no custom all-reduce "
                                  "(XLA's collectives)"),
    "hf_token": (lambda v: v is None, "set the HF_TOKEN environment variable instead"),
    "hf_overrides": (lambda v: not v, "the checkpoint's config.json is read as it is"),
    "compilation_config": (lambda v: not v, "XLA compiles every program; see enforce_eager"),
    "distributed_executor_backend": (lambda v: v is None, "one process per host "
                                     "(jax.distributed across hosts); see mesh"),
    "enable_lora": (lambda v: v is False, "LoRA adapters are not implemented"),
    "enable_sleep_mode": (lambda v: v is False, "sleep mode is not implemented"),
    "task": (lambda v: v in ("auto", "generate"), "jaxserve generates text only"),
    "runner": (lambda v: v in ("auto", "generate"), "jaxserve generates text only"),
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
            is_true_here, why = VLLM_ONLY[name]
            if not is_true_here(value):
                raise ValueError(f"LLM({name}={value!r}) is not supported by jaxserve: {why}")
            continue
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


def _suggestion(name: str) -> str:
    known = [n for n in (*_FIELDS, *ALIASES, *VLLM_ONLY) if n != "model"]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
