"""Server flags and request -> SamplingParams translation, without a server."""
from __future__ import annotations

import json
import os

import pytest

from jaxserve.cli.serve import engine_config, generation_defaults, parser
from jaxserve.config import EngineConfig
from jaxserve.api.protocol import CompletionRequest, sampling_params


def test_generation_config_supplies_defaults_requests_override(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": 2}))
    defaults = generation_defaults("auto", str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert generation_defaults("vllm", str(tmp_path)) == {}
    plain = sampling_params(CompletionRequest(prompt="x"), defaults, max_tokens=16, logprobs=None)
    assert (plain.temperature, plain.top_p, plain.top_k) == (0.6, 0.9, 20)
    mine = sampling_params(CompletionRequest(prompt="x", temperature=0.0, top_k=5), defaults,
                           max_tokens=16, logprobs=None)
    assert (mine.temperature, mine.top_k) == (0.0, 0)   # greedy resets top_k
    with pytest.raises(ValueError, match="generation_config.json"):
        generation_defaults(str(tmp_path / "missing"), str(tmp_path))


def test_flags_use_vllm_names_and_aliases():
    args = parser().parse_args(["--model", "/m", "--block-size", "32",
                                "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching",
                                "--max-num-seqs", "8", "--max-num-batched-tokens", "64"])
    cfg = engine_config(args)
    assert (cfg.page_size, cfg.hbm_utilization, cfg.enable_prefix_caching) == (32, 0.5, False)
    assert args.port == 8000
    for action in parser()._actions:
        if action.dest != "help":
            assert action.help, f"--{action.dest} has no help text"


@pytest.mark.parametrize("flag, expected", [
    ([], "default"), (["--compilation-cache-dir", "/tmp/xla"], "/tmp/xla"),
    (["--compilation-cache-dir", ""], None), (["--compilation-cache-dir", "none"], None),
    (["--compilation-cache-dir", "None"], None)])
def test_compilation_cache_dir_flag(flag, expected, monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSERVE_COMPILATION_CACHE", str(tmp_path / "from-env"))
    cfg = engine_config(parser().parse_args(["--model", "/m", *flag]))
    if expected == "default":   # no flag: EngineConfig's default (here: the env variable)
        expected = str(tmp_path / "from-env")
    assert cfg.compilation_cache_dir == expected


@pytest.mark.parametrize("value", ["none", "None", ""])
def test_the_environment_turns_the_compilation_cache_off_as_the_flag_does(value, monkeypatch):
    """JAXSERVE_COMPILATION_CACHE=none once made a cache folder named "none" in the working
    directory; from the flag, the environment and Python alike 'none' means no cache."""
    monkeypatch.setenv("JAXSERVE_COMPILATION_CACHE", value)
    assert engine_config(parser().parse_args(["--model", "/m"])).compilation_cache_dir is None
    assert EngineConfig(model="/m").compilation_cache_dir is None
    monkeypatch.setenv("JAXSERVE_COMPILATION_CACHE", "~/xla-here")
    assert EngineConfig(model="/m").compilation_cache_dir == os.path.expanduser("~/xla-here")
    assert EngineConfig(model="/m", compilation_cache_dir="NONE").compilation_cache_dir is None


def test_no_model_means_the_builtin_random_model(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    cfg = engine_config(parser().parse_args([]))
    assert cfg.load_format == "dummy" and cfg.model.startswith(str(tmp_path))
    assert (tmp_path / "jaxserve-tiny-random" / "config.json").exists()


def test_alias_with_dummy_weights_gets_as_far_as_building_the_model(tmp_path, monkeypatch,
                                                                  caplog):
    """`python -m jaxserve.api --model qwen3-8b --load-format dummy`: the alias becomes a
    generated directory and the 8B flax model is built; loading its 16 GB of random
    weights is where this test stops it. The engine is built while the server listens:
    its failure stops the server, is logged, and the exit status is 1."""
    from jaxserve.cli.serve import main
    from jaxserve.build import loader
    from tests.api.conftest import free_port
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    built = {}

    class Stop(Exception):
        pass

    def stop(model_dir, mc, model, *args, **kwargs):
        built.update(model_dir=model_dir, mc=mc, model=model)
        raise Stop
    monkeypatch.setattr(loader, "load_params", stop)
    with pytest.raises(SystemExit) as e:
        main(["--model", "qwen3-8b", "--load-format", "dummy", "--max-model-len", "4096",
              "--port", str(free_port())])
    assert e.value.code == 1
    assert any("the engine failed to start (Stop" in r.getMessage() for r in caplog.records)
    assert built["model_dir"] == str(tmp_path / "dummy" / "qwen3-8b")
    assert type(built["model"]).__name__ == "Qwen3ForCausalLM"
    assert (built["mc"].num_layers, built["mc"].hidden_size) == (36, 4096)


def test_missing_model_is_a_clean_error(tmp_path, monkeypatch, capsys):
    from jaxserve.cli.serve import main
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        main(["--model", "qwen3.6-27b"])
    assert e.value.code == 2
    err = capsys.readouterr().err   # offline: tests/conftest.py sets HF_HUB_OFFLINE=1
    assert "HF_HUB_OFFLINE is on" in err and "hf download Qwen/Qwen3.6-27B" in err
