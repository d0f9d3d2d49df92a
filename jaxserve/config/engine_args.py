"""Command-line flags made from EngineConfig's fields, so that a flag's name, type,
default and help have one owner: the field (its help, vLLM aliases and choices are the
field's metadata, jaxserve/config/engine_config.py). The server, the planner and
`python -m jaxserve.generate` add the flags they take with `add_engine_args`; their
other flags (host, port, API key, ...) are their own."""
from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

from jaxserve.config import DTYPE_ALIASES, EngineConfig
from jaxserve.config.engine_config import compilation_cache_setting
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.config.vllm_compat import BOOL, FLOAT, INT, JSON, LIST, OPTIONAL, SWITCH, Setting, \
    parse_json
from jaxserve.errors import ConfigError

_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}

# Every field with help metadata is a flag, in EngineConfig's order.
FLAGS: tuple[str, ...] = tuple(name for name, f in _FIELDS.items() if "help" in f.metadata)

# EngineConfig's other fields, and why none of them is a shared flag.
NOT_FLAGS: dict[str, str] = {
    "model": "each command spells its own: the server's defaults to the built-in tiny model, "
             "the planner's is required and also takes a config.json",
    "scan_layers": "LLM only (a debugging switch): the platform picks, scan on accelerators "
                   "(python -m jaxserve.convert has its own --scan-layers: the layout it "
                   "writes)",
}


# Size suffixes as vLLM reads them: lower case decimal, upper case binary.
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def dashed(argv: list[str]) -> list[str]:
    """vLLM's flags may be spelt with underscores (--max_model_len 4k): the same flags
    with dashes. Values are left as they are."""
    return [re.sub(r"^--[^=]+", lambda m: m.group(0).replace("_", "-"), arg)
            if arg.startswith("--") else arg for arg in argv]


def human_readable_int(text: str) -> int:
    """"32768", "32k" (32,000), "32K" (32,768), "1.5m" (1,500,000), "4G" (4 GiB). A
    fraction takes only a decimal suffix (1.5K is not a whole number of tokens)."""
    value = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if m is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid size {text!r}: an integer, optionally with a suffix k/m/g/t "
                f"(x 1000^n) or K/M/G/T (x 1024^n)") from None
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: {suffix} is binary (x {_BINARY[suffix]:,}) and takes a "
            f"whole number; {number}{suffix.lower()} is decimal")
    return int(number) * _BINARY[suffix]


def _model_len(text: str) -> int | None:
    """--max-model-len: a size, or 'auto' / -1 for the model's own (None)."""
    return None if text.strip().lower() in ("auto", "-1") else human_readable_int(text)


# Fields whose flag parses its text with more than the field's type.
_PARSERS: dict[str, typing.Callable[[str], Any]] = {
    "compilation_cache_dir": compilation_cache_setting,
    "dtype": lambda value: DTYPE_ALIASES.get(value, value),   # half -> float16
    "speculative_config": str,   # JSON, parsed (and checked) by EngineConfig
    "max_model_len": _model_len,
    "max_num_batched_tokens": human_readable_int,
    "kv_cache_memory_bytes": human_readable_int,
    "limit_mm_per_prompt": lambda text: _json(text),
    "lora_modules": str,   # name=path or JSON, parsed (and checked) by EngineConfig
    "mm_processor_kwargs": lambda text: _json(text)}


class EnableDisableAction(argparse.BooleanOptionalAction):
    """An on/off flag in every spelling vLLM takes: --x and --no-x, and for --enable-x
    also --disable-x (or for --disable-x also --enable-x)."""

    _FLIP = {"--enable-": "--disable-", "--disable-": "--enable-"}

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        flipped = [new + opt[len(old):] for opt in option_strings
                   for old, new in self._FLIP.items() if opt.startswith(old)]
        self._off = {opt for opt in self.option_strings if opt not in option_strings}
        self._off |= set(flipped)
        self.option_strings = [*self.option_strings, *flipped]

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, option_string not in self._off)


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
            kw["action"] = EnableDisableAction
        else:
            kw["type"] = _PARSERS.get(name, value_type)
            if meta.get("nargs"):
                kw["nargs"] = meta["nargs"]
            if meta["choices"]:
                kw["choices"] = meta["choices"]
        parser.add_argument(flag_name(name), *meta["aliases"], **kw)
        if name == "speculative_config":
            _add_spec_shorthands(parser)


# vLLM's shorthands of --speculative-config's keys.
_SPEC_SHORTHANDS = {"spec_method": "method", "spec_model": "model",
                    "spec_tokens": "num_speculative_tokens"}


def _add_spec_shorthands(parser: argparse.ArgumentParser) -> None:
    for name, key, kind in (("spec_method", "method", str), ("spec_model", "model", str),
                            ("spec_tokens", "num_speculative_tokens", int)):
        parser.add_argument(flag_name(name), dest=name, type=kind, default=argparse.SUPPRESS,
                            help=f"--speculative-config's {key!r}, as a flag of its own")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the engine flags `args` holds. ConfigError
    when --speculative-config and its shorthands are both given."""
    out = {name: getattr(args, name) for name in FLAGS if hasattr(args, name)}
    spec = {key: getattr(args, name) for name, key in _SPEC_SHORTHANDS.items()
            if hasattr(args, name)}
    if spec:
        if out.get("speculative_config") is not None:
            raise ConfigError("speculative_config", "give --speculative-config or its "
                              "shorthands (--spec-method, --spec-model, --spec-tokens), not "
                              "both")
        try:   # checked here, so that a bad value names the shorthand given
            out["speculative_config"] = SpeculativeConfig.parse(spec)
        except ValueError as e:
            raise ConfigError("spec_method", f"--spec-method/--spec-model/--spec-tokens: "
                              f"{e}") from None
    return out


# ---- vLLM's flags that have no jaxserve knob (jaxserve/config/vllm_compat.py) ----------------

_COMPAT_DEST = "vllm_compat:"
_COMPAT_PARSE: dict[str, typing.Callable[[str], Any]] = {INT: int, FLOAT: float}


def _json(text: str) -> Any:
    try:
        return parse_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_vllm_compat_args(parser: argparse.ArgumentParser, settings: Mapping[str, Setting],
                         title: str) -> None:
    """Flags for vLLM settings jaxserve has no knob for: parsed as vLLM spells them,
    checked by check_vllm_compat."""
    group = parser.add_argument_group(title, "vLLM's flags for parts jaxserve does not have: "
                                      "a value that is true of jaxserve is taken, any other "
                                      "stops the start with the reason")
    for name, s in settings.items():
        kw: dict[str, Any] = {"dest": _COMPAT_DEST + name, "default": argparse.SUPPRESS,
                              "help": f"{s.why} (taken: {s.accepted_text()})"}
        if s.kind not in (BOOL, SWITCH):
            kw["metavar"] = name.upper()
        if s.kind == BOOL:
            kw["action"] = EnableDisableAction
        elif s.kind == SWITCH:
            kw["action"] = "store_true"
        elif s.kind == OPTIONAL:
            kw.update(nargs="?", const=True)
        else:
            kw["type"] = _json if s.kind == JSON else _COMPAT_PARSE.get(s.kind, str)
            if s.kind == LIST:
                kw["nargs"] = "+"
        group.add_argument(flag_name(name), *s.short, **kw)


def check_vllm_compat(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      settings: Mapping[str, Setting]) -> list[str]:
    """Exit 2 naming the first vLLM-only flag given a value jaxserve cannot honour; else
    what each one given means here (for the start-up log)."""
    notes = []
    for name, s in settings.items():
        dest = _COMPAT_DEST + name
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if not s.holds(value):
            parser.error(f"argument {flag_name(name)}: {value!r} is not supported by "
                         f"jaxserve: {s.why} (it takes {s.accepted_text()})")
        notes.append(f"{flag_name(name)} {value!r}: taken ({s.why})")
    return notes


def config_error(parser: argparse.ArgumentParser, error: ConfigError) -> NoReturn:
    """Exit 2 with argparse's usage line and the flag the bad value came from, in every
    spelling (--gpu-memory-utilization is --hbm-utilization), as argparse names one."""
    spellings = [a.option_strings for a in parser._actions if a.dest == error.field]
    if spellings and spellings[0]:
        parser.error(f"argument {'/'.join(spellings[0])}: {error}")
    parser.error(str(error))
