"""`--config FILE`: a YAML file of flags, as vLLM's. Its keys are flag names without the
leading dashes (`tensor-parallel-size: 2`; underscores work too); flags given on the
command line win over the file's."""
from __future__ import annotations

import argparse
import json

import yaml


def expand_config_file(ap: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with the flags of its --config FILE (if any) put first, so that the command
    line's own flags, parsed later, override them. Exits 2 (ap.error) for a file that is
    missing, not a mapping, or names a flag `ap` does not have."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    if known.config is None:
        return argv
    try:
        with open(known.config) as f:
            settings = yaml.safe_load(f)
    except OSError as e:
        ap.error(f"argument --config: cannot read {known.config!r}: {e.strerror}")
    except yaml.YAMLError as e:
        ap.error(f"argument --config: {known.config!r} is not valid YAML: {e}")
    if settings is None:
        return rest
    if not isinstance(settings, dict):
        ap.error(f"argument --config: {known.config!r} must hold a mapping of flag names to "
                 f"values, not a {type(settings).__name__}")
    actions = {opt: a for a in ap._actions for opt in a.option_strings}
    positional = {a.dest: a for a in ap._actions if not a.option_strings}
    flags: list[str] = []
    for key, value in settings.items():
        flags += _as_flags(ap, known.config, str(key), value, actions, positional)
    return flags + rest


def _as_flags(ap: argparse.ArgumentParser, path: str, key: str, value,
              actions: dict[str, argparse.Action],
              positional: dict[str, argparse.Action]) -> list[str]:
    flag = "--" + key.lstrip("-").replace("_", "-")
    action = actions.get(flag)
    if action is None and key in positional:   # `model: ...` for `jaxserve serve MODEL`
        return [str(value)]
    if action is None or flag == "--config":
        ap.error(f"argument --config: {path!r} sets {key!r}, which is not a flag of this "
                 f"command (see --help)")
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            ap.error(f"argument --config: {key!r} must be true or false, got {value!r}")
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:   # store_true
        if not isinstance(value, bool):
            ap.error(f"argument --config: {key!r} must be true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [flag, *(str(v) for v in value)]
    if isinstance(value, (list, dict)):   # a JSON-valued flag (--allowed-origins, ...)
        return [flag, json.dumps(value)]
    return [flag, "" if value is None else str(value)]
