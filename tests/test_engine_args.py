"""The engine flags of the server, the planner and generate are EngineConfig's fields:
same names, types and defaults, or a field says why it has no flag."""
from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from jaxserve.cli import serve as cli
from jaxserve.config import EngineConfig, default_max_num_seqs
from jaxserve.config.engine_args import FLAGS, NOT_FLAGS, flag_name
from jaxserve.config.vllm_compat import ENGINE

FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def engine_actions(ap: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in ap._actions if a.dest in FIELDS and a.dest != "model"}


def field_default(name: str):
    f = FIELDS[name]
    return argparse.SUPPRESS if f.default is dataclasses.MISSING else f.default


def test_every_field_is_a_flag_or_says_why_not():
    assert set(FLAGS) | set(NOT_FLAGS) == set(FIELDS)
    assert not set(FLAGS) & set(NOT_FLAGS)
    assert all(NOT_FLAGS.values())


def test_server_flags_are_engine_config_fields():
    actions = engine_actions(cli.parser())
    assert set(actions) == set(FLAGS)   # the server takes every engine flag
    hints = typing.get_type_hints(EngineConfig)
    for name, action in actions.items():
        assert flag_name(name) in action.option_strings
        assert action.default == field_default(name), name
        value_type = next(t for t in typing.get_args(hints[name]) or (hints[name],)
                          if t is not type(None))
        if value_type is bool:
            assert isinstance(action, argparse.BooleanOptionalAction), name
        elif name not in ("compilation_cache_dir", "dtype", "speculative_config",
                          "max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes",
                          "limit_mm_per_prompt", "mm_processor_kwargs", "lora_modules"):
            # ('' / 'none' = off; half; JSON text, parsed by EngineConfig; sizes as 32k;
            # JSON objects)
            assert action.type is value_type, name
    # No flags at all: EngineConfig's own defaults (max_num_seqs: the platform's).
    args = cli.parser().parse_args(["--model", "/m"])
    assert cli.engine_config(args) == EngineConfig(model="/m")
    assert EngineConfig(model="/m").for_platform("cpu").max_num_seqs == default_max_num_seqs("cpu") == 64
    assert EngineConfig(model="/m").for_platform("tpu").max_num_seqs == 256


@pytest.mark.parametrize("flag, value, field, expected", [
    ("--block-size", "32", "page_size", 32), ("--page-size", "8", "page_size", 8),
    ("--gpu-memory-utilization", "0.5", "hbm_utilization", 0.5),
    ("--hbm-utilization", "0.7", "hbm_utilization", 0.7),
    ("--max-num-seqs", "8", "max_num_seqs", 8), ("--attention-backend", "xla",
                                                 "attention_backend", "xla")])
def test_todays_spellings_still_work(flag, value, field, expected):
    cfg = cli.engine_config(cli.parser().parse_args(["--model", "/m", flag, value]))
    assert getattr(cfg, field) == expected


@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "0"], "argument --max-num-seqs: max_num_seqs=0: must be >= 1"),
    (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'"),
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["--max-num-batched-tokens", "32", "--max-num-seqs", "64"],
     "argument --max-num-batched-tokens: max_num_batched_tokens=32: must be >= max_num_seqs"),
    (["--block-size", "12"], "argument --page-size/--block-size: page_size=12: must be a "
                             "positive power"),
    (["--mesh", "2y4"], "argument --mesh: "),
    (["--calculate-kv-scales"], "argument --calculate-kv-scales/--no-calculate-kv-scales: "
                                "calculate_kv_scales=True: scales belong to a quantized KV "
                                "cache"),
    (["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag 1")])
def test_bad_values_exit_2_naming_the_flag(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))   # where the default model goes
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m jaxserve.api") and message in err, err


def test_the_planner_takes_every_engine_flag_of_the_server():
    """One flag set: `jaxserve plan` takes what `jaxserve serve` takes for the engine
    (speculation included, and vLLM's engine flags without a knob) and builds the same
    EngineConfig from it."""
    from jaxserve.cli import plan as plan_cli
    ap = plan_cli.parser()
    actions, server = engine_actions(ap), engine_actions(cli.parser())
    assert set(actions) == set(server) == set(FLAGS)
    for name, action in actions.items():   # the very flags the server has
        assert (action.option_strings, action.type, action.help, action.default) == \
            (server[name].option_strings, server[name].type, server[name].help,
             server[name].default), name
    compat = {a.dest for a in ap._actions if a.dest.startswith("vllm_compat:")}
    assert compat == {"vllm_compat:" + n for n in ENGINE}
    _, config = plan_cli.parse_args(ap, ["--model", "qwen3-8b"])
    assert config == cli.engine_config(cli.parser().parse_args(["--model", "qwen3-8b"]))
    flags = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
             "-tp", "2", "--max-model-len", "8k", "--kv-cache-memory-bytes", "1G"]
    _, planned = plan_cli.parse_args(ap, ["--model", "qwen3-8b", *flags])
    served = cli.engine_config(cli.parse_args(cli.parser(), ["--model", "qwen3-8b", *flags]))
    assert planned == served and planned.speculative_config.num_speculative_tokens == 2
    # A plan is for an accelerator: EngineConfig's defaults there.
    assert config.for_platform("gpu").max_num_seqs == default_max_num_seqs("gpu") == 256


def test_convert_flags_are_engine_config_fields():
    from jaxserve.cli import convert
    actions = engine_actions(convert.parser())
    # --scan-layers is convert's own (EngineConfig.scan_layers has no engine flag).
    assert set(actions) == set(convert.CONVERT_ENGINE_FLAGS) | {"scan_layers"}
    for name in convert.CONVERT_ENGINE_FLAGS:
        assert actions[name].default == field_default(name), name
    args = convert.parser().parse_args(["--model", "/m", "--output", "/o", "--mesh", "2x4"])
    assert (args.mesh, args.scan_layers, args.output) == ("2x4", None, "/o")


def test_generate_defaults_are_engine_config_defaults_but_its_rows():
    from jaxserve.cli import generate
    actions = engine_actions(generate.parser())
    assert set(actions) == set(generate.GENERATE_ENGINE_FLAGS)
    for name, action in actions.items():
        if name != "max_num_seqs":
            assert action.default == field_default(name), name
    assert actions["max_num_seqs"].default == 16 and "(default: 16)" in actions[
        "max_num_seqs"].help
