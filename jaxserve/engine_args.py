"""Command-line flags made from EngineConfig's fields, so that a flag's name, type,
default and help have one owner: the field (its help, vLLM aliases and choices are the
field's metadata, jaxserve/config.py). The server, the planner and
`python -m jaxserve.generate` add the flags they take with `add_engine_args`; their
other flags (host, port, API key, ...) are their own."""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Iterable
from typing import Any, NoReturn

from jaxserve.config import DTYPE_ALIASES, ConfigError, EngineConfig

_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}

# Every field with help metadata is a flag, in EngineConfig's order.
FLAGS: tuple[str, ...] = tuple(name for name, f in _FIELDS.items() if "help" in f.metadata)

# EngineConfig's other fields, and why none of them is a shared flag.
NOT_FLAGS: dict[str, str] = {
    "model": "each command spells its own: the server's defaults to the built-in tiny model, "
             "the planner's is required and also takes a config.json",
    "num_pages": "LLM only (tests, benchmarks): on the command line --hbm-utilization sizes "
                 "the KV cache",
    "scan_layers": "LLM only (a debugging switch): the platform picks, scan on accelerators "
                   "(python -m jaxserve.convert has its own --scan-layers: the layout it "
                   "writes)",
}


def _cache_dir(value: str) -> str | None:
    """--compilation-cache-dir: '' or 'none' turns the cache off (None)."""
    return None if value.strip().lower() in ("", "none") else os.path.expanduser(value)


# Fields whose flag parses its text with more than the field's type.
_PARSERS: dict[str, typing.Callable[[str], Any]] = {
    "compilation_cache_dir": _cache_dir,
    "dtype": lambda value: DTYPE_ALIASES.get(value, value),   # half -> float16
    "speculative_config": str}   # JSON, parsed (and checked) by EngineConfig


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _value_type(hint: Any) -> type:
    """int for `int` and `int | None`."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [t for t in typing.get_args(hint) if t is not type(None)]
    return hint


def add_engine_args(parser: argparse.ArgumentParser, fields: Iterable[str] = FLAGS, *,
                    defaults: dict[str, Any] | None = None) -> None:
    """Add the flags of `fields` (EngineConfig field names) to `parser`. defaults: a
    command's own defaults for some of them (said in their help)."""
    hints = typing.get_type_hints(EngineConfig)
    defaults = defaults or {}
    for name in fields:
        if name not in FLAGS:
            raise ValueError(f"EngineConfig.{name} has no flag (see NOT_FLAGS)")
        f = _FIELDS[name]
        meta = f.metadata
        if name in defaults:
            default, said = defaults[name], defaults[name]
        elif f.default is dataclasses.MISSING:
            # A default computed at construction (default_factory): an absent flag leaves
            # it to EngineConfig, so the flag has no default of its own to drift.
            default, said = argparse.SUPPRESS, meta["default_help"]
        else:
            default, said = f.default, meta["default_help"] or f.default
        kw = {"dest": name, "default": default, "help": meta["help"]}
        if said is not None:
            kw["help"] += f" (default: {said})"
        value_type = _value_type(hints[name])
        if value_type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _PARSERS.get(name, value_type)
            if meta["choices"]:
                kw["choices"] = meta["choices"]
        parser.add_argument(flag_name(name), *meta["aliases"], **kw)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the engine flags `args` holds."""
    return {name: getattr(args, name) for name in FLAGS if hasattr(args, name)}


def config_error(parser: argparse.ArgumentParser, error: ConfigError) -> NoReturn:
    """Exit 2 with argparse's usage line and the flag the bad value came from."""
    if error.field in FLAGS:
        parser.error(f"argument {flag_name(error.field)}: {error}")
    parser.error(str(error))
