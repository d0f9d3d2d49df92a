"""vLLM's `--speculative-config` on the server (a JSON object), in a `--config` YAML file,
and `LLM(speculative_config=...)` (a dict): each parses to EngineConfig's
SpeculativeConfig, or is refused naming the flag. No server or engine starts here."""
from __future__ import annotations

import json

import pytest

from jaxserve.cli.serve import engine_config, parse_args, parser
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_kwargs import engine_kwargs
from jaxserve.errors import ConfigError
from jaxserve.config.speculative import SpeculativeConfig
from tests.api.test_vllm_flags import SERVE, config_of

FLAG = "--speculative-config"


@pytest.mark.parametrize("prog", [SERVE, "python -m jaxserve.api"])
def test_the_flag_is_in_help(prog):
    help_text = parser(prog).format_help()
    assert FLAG in help_text and "ngram" in help_text


def test_off_by_default():
    assert config_of().speculative_config is None


@pytest.mark.parametrize("text, expected", [
    ('{"method": "ngram", "num_speculative_tokens": 3}',
     SpeculativeConfig(method="ngram", num_speculative_tokens=3)),
    ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
     '"prompt_lookup_min": 1}',
     SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=4, prompt_lookup_min=1)),
    ('{"model": "[ngram]", "num_speculative_tokens": 2}',   # vLLM's older spelling
     SpeculativeConfig(num_speculative_tokens=2)),
    ('{"method": "ngram"}', SpeculativeConfig()),
])
def test_the_flag_parses_to_a_speculative_config(text, expected):
    assert config_of(FLAG, text).speculative_config == expected


@pytest.mark.parametrize("text, message", [
    ("{method: ngram}", "is not JSON"),
    ('["ngram"]', "must be a JSON object"),
    ('{"method": "ngram", "foo": 1}', "'foo' not supported"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens=99"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min=4 > prompt_lookup_max=2"),
    # Methods that stay unimplemented, refused by name, and an unknown one.
    ('{"method": "eagle", "num_speculative_tokens": 3}', "method 'eagle'"),
    ('{"method": "medusa", "num_speculative_tokens": 3}', "method 'medusa'"),
    ('{"method": "foo", "num_speculative_tokens": 3}', "method 'foo'"),
])
def test_bad_values_exit_2_naming_the_flag(text, message, capsys):
    with pytest.raises(SystemExit) as e:
        config_of(FLAG, text)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {SERVE}") and f"argument {FLAG}/-sc: " in err, err
    assert message in err, err


@pytest.mark.parametrize("yaml_value", [
    "{method: ngram, num_speculative_tokens: 2}",          # a YAML mapping
    "'{\"method\": \"ngram\", \"num_speculative_tokens\": 2}'",   # the flag's JSON text
])
@pytest.mark.parametrize("key", ["speculative-config", "speculative_config"])
def test_config_file(key, yaml_value, tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: /m\n{key}: {yaml_value}\n")
    config = engine_config(parse_args(parser(SERVE), ["--config", str(cfg)]))
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    # The command line wins over the file.
    args = parse_args(parser(SERVE), ["--config", str(cfg), FLAG,
                                      '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert engine_config(args).speculative_config.num_speculative_tokens == 4


def test_config_file_with_a_bad_value_exits_2_naming_the_flag(tmp_path, capsys):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: /m\nspeculative-config: {method: eagle}\n")
    with pytest.raises(SystemExit) as e:
        config_of("--config", str(cfg))
    assert e.value.code == 2
    assert f"argument {FLAG}/-sc: " in capsys.readouterr().err


# ---- LLM(speculative_config=...) --------------------------------------------------------
def llm_config(**kwargs) -> EngineConfig:
    """What LLM("/m", **kwargs) builds its engine from (jaxserve/engine/llm.py)."""
    return EngineConfig(model="/m", **engine_kwargs(kwargs))


@pytest.mark.parametrize("value", [
    {"method": "ngram", "num_speculative_tokens": 3},
    json.dumps({"method": "ngram", "num_speculative_tokens": 3}),
    SpeculativeConfig(num_speculative_tokens=3),
])
def test_llm_takes_a_dict_its_json_or_a_speculative_config(value):
    assert llm_config(speculative_config=value).speculative_config == \
        SpeculativeConfig(method="ngram", num_speculative_tokens=3)


def test_llm_without_it_is_off():
    assert llm_config().speculative_config is None
    assert llm_config(speculative_config=None).speculative_config is None


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle"}, "method 'eagle'"),
    ({"method": "medusa"}, "method 'medusa'"),
    ({"method": "foo"}, "method 'foo'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "foo": 1}, "'foo' not supported"),
])
def test_llm_refuses_bad_values(value, message):
    with pytest.raises(ConfigError, match=message) as e:
        llm_config(speculative_config=value)
    assert e.value.field == "speculative_config"
