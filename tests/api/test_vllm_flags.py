"""vLLM's `vllm serve` flags on `jaxserve serve`: each parses to the EngineConfig (or
server setting) it means, or exits 2 with a message naming the flag and the reason."""
from __future__ import annotations

import json

import pytest

from jaxserve.api.cli import checked_config, engine_config, parse_args, parser
from jaxserve.config import EngineConfig

SERVE = "jaxserve serve"


def config_of(*argv: str) -> EngineConfig:
    ap = parser(SERVE)
    return checked_config(ap, parse_args(ap, ["/m", *argv]))


@pytest.mark.parametrize("argv, expected", [
    (["--tensor-parallel-size", "2"], {"mesh": "1x2", "tensor_parallel_size": 2}),
    (["-tp", "4", "-dp", "2"], {"mesh": "2x4"}),
    (["--data-parallel-size", "2"], {"mesh": "2x1"}),
    (["--mesh", "2x4", "-tp", "4"], {"mesh": "2x4"}),
    (["-pp", "1"], {"pipeline_parallel_size": 1, "mesh": None}),
    (["--gpu-memory-utilization", "0.5"], {"hbm_utilization": 0.5}),
    ([], {"hbm_utilization": None}),   # the platform's default, resolved by the engine
    (["--kv-cache-memory-bytes", "1048576"], {"kv_cache_memory_bytes": 1 << 20}),
    (["--max-logprobs", "5"], {"max_logprobs": 5}),
    (["--max-logprobs", "-1"], {"max_logprobs": -1}),
    (["--tokenizer", "/tok"], {"tokenizer": "/tok"}),
    (["--revision", "v1.0"], {"revision": "v1.0"}),
    (["--download-dir", "/dl"], {"download_dir": "/dl"}),
    (["--trust-remote-code"], {"trust_remote_code": True}),
    (["--dtype", "half"], {"dtype": "float16"}),
    (["--dtype", "float"], {"dtype": "float32"}),
    (["--dtype", "bfloat16"], {"dtype": "bfloat16"}),
    (["--enable-chunked-prefill"], {"enable_chunked_prefill": True}),
    (["--enforce-eager"], {"enforce_eager": True}),
    (["--swap-space", "0"], {"swap_space": 0.0}),
    (["--preemption-mode", "recompute"], {"preemption_mode": "recompute"}),
    (["--no-async-scheduling"], {"async_scheduling": False}),
    (["--block-size", "32"], {"page_size": 32}),
    (["--seed", "7"], {"seed": 7}),
    (["--max-model-len", "4096"], {"max_model_len": 4096}),
    (["--max-num-seqs", "8"], {"max_num_seqs": 8}),
    (["--max-num-batched-tokens", "8192"], {"max_num_batched_tokens": 8192}),
    (["--quantization", "fp8", "--kv-cache-dtype", "fp8"],
     {"quantization": "fp8", "kv_cache_dtype": "fp8"}),
    (["-q", "int8"], {"quantization": "int8"}),
    (["--enable-prefix-caching"], {"enable_prefix_caching": True}),
    (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
    (["--load-format", "dummy"], {"load_format": "dummy"}),
    (["--scheduling-policy", "priority"], {"scheduling_policy": "priority"}),
])
def test_vllm_engine_flags_parse_to_engine_config(argv, expected):
    cfg = config_of(*argv)
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert cfg.model == "/m"


@pytest.mark.parametrize("argv, message", [
    (["-pp", "2"], "argument --pipeline-parallel-size: pipeline_parallel_size=2: jaxserve has "
                   "no pipeline parallelism"),
    (["--swap-space", "4"], "argument --swap-space: swap_space=4.0: jaxserve never swaps"),
    (["--preemption-mode", "swap"], "argument --preemption-mode: preemption_mode='swap': "
                                    "jaxserve preempts by recomputation only"),
    (["--async-scheduling"], "argument --async-scheduling: async_scheduling=True: not "
                             "implemented"),
    (["--no-enable-chunked-prefill"], "argument --enable-chunked-prefill: "
                                      "enable_chunked_prefill=False: chunked prefill is always on"),
    (["--mesh", "1x4", "-tp", "2"], "argument --tensor-parallel-size: tensor_parallel_size=2: "
                                    "disagrees with mesh='1x4'"),
    (["-tp", "0"], "argument --tensor-parallel-size: tensor_parallel_size=0: must be >= 1"),
    (["--gpu-memory-utilization", "1.5"], "argument --hbm-utilization: hbm_utilization=1.5: "
                                          "must be in (0, 1]"),
    (["--max-logprobs", "-2"], "argument --max-logprobs: max_logprobs=-2: must be >= 0"),
    (["--dtype", "double"], "argument --dtype: invalid choice: 'double'"),
    (["--chat-template", "/no/such/template.jinja"],
     "argument --chat-template: '/no/such/template.jinja' is neither a file nor a Jinja "
     "template"),
    (["--override-generation-config", '{"max_new_tokens": 5}'],
     "argument --override-generation-config: 'max_new_tokens' cannot be overridden"),
    (["--override-generation-config", "temperature=0.5"],
     "argument --override-generation-config: not JSON"),
    (["--ssl-keyfile", "/k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--allowed-origins", "*"], "argument --allowed-origins: not JSON"),
    (["--allowed-origins", '{"a": 1}'], "argument --allowed-origins: must be a JSON list"),
    (["--uvicorn-log-level", "loud"], "argument --uvicorn-log-level: invalid choice"),
    (["--max-log-len", "0"], "argument --max-log-len: must be >= 1, got 0"),
    (["--model", "/other"], "the model is given twice: '/m' and --model '/other'"),
    (["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag 1"),
    (["--tensor-parallel-size"], "argument --tensor-parallel-size/-tp: expected one argument"),
])
def test_refused_flags_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        config_of(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {SERVE}") and message in err, err


def test_server_flags():
    args = parse_args(parser(SERVE), [
        "/m", "--served-model-name", "big", "small", "--uvicorn-log-level", "debug",
        "--root-path", "/llm", "--disable-log-stats", "--allowed-origins", '["https://a.b"]',
        "--allowed-methods", '["GET", "POST"]', "--allow-credentials",
        "--override-generation-config", '{"temperature": 0.25}', "--chat-template", "{{ x }}",
        "--max-log-len", "80"])
    assert args.model == "/m" and args.served_model_name == ["big", "small"]
    assert (args.uvicorn_log_level, args.root_path, args.disable_log_stats) == \
        ("debug", "/llm", True)
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers,
            args.allow_credentials) == (["https://a.b"], ["GET", "POST"], ["*"], True)
    assert args.override_generation_config == {"temperature": 0.25}
    assert args.chat_template == "{{ x }}"   # a template, not a path
    assert args.max_log_len == 80
    defaults = parse_args(parser(), ["--model", "/m"])
    assert defaults.served_model_name is None and defaults.allowed_origins == ["*"]
    assert not defaults.disable_log_stats and defaults.max_log_len == 1000


def test_chat_template_file_is_read(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = parse_args(parser(SERVE), ["/m", "--chat-template", str(path)])
    assert args.chat_template == path.read_text()


def test_override_generation_config_goes_over_the_models(tmp_path):
    from jaxserve.api.cli import generation_defaults
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6,
                                                                 "top_k": 20}))
    assert generation_defaults("auto", str(tmp_path), {"temperature": 0.1, "min_p": 0.05}) == \
        {"temperature": 0.1, "top_k": 20, "min_p": 0.05}
    assert generation_defaults("vllm", str(tmp_path), {"top_p": 0.5}) == {"top_p": 0.5}


def test_config_file_flags_and_the_command_line_wins(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: /from-yaml\n"
                   "tensor-parallel-size: 2\n"
                   "max_num_seqs: 8\n"             # underscores work too
                   "enable-prefix-caching: false\n"
                   "disable-log-stats: true\n"
                   "served-model-name: [one, two]\n"
                   "override-generation-config: {temperature: 0.5}\n"
                   "port: 9001\n")
    args = parse_args(parser(SERVE), ["--config", str(cfg), "--max-num-seqs", "4"])
    assert (args.model, args.port, args.served_model_name) == ("/from-yaml", 9001,
                                                               ["one", "two"])
    assert args.disable_log_stats and args.override_generation_config == {"temperature": 0.5}
    config = engine_config(args)
    assert (config.mesh, config.max_num_seqs, config.enable_prefix_caching) == ("1x2", 4, False)
    # python -m jaxserve.api takes the same file (model as a flag there).
    assert parse_args(parser(), ["--config", str(cfg)]).model == "/from-yaml"


@pytest.mark.parametrize("text, message", [
    ("no-such-flag: 1\n", "sets 'no-such-flag', which is not a flag of this command"),
    ("- a\n- b\n", "must hold a mapping of flag names to values, not a list"),
    ("enforce-eager: maybe\n", "'enforce-eager' must be true or false"),
    ("port: [1, 2]\n", "argument --port: invalid int value: '[1, 2]'"),
    ("port: [\n", "is not valid YAML"),
])
def test_bad_config_files_exit_2(text, message, tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as e:
        parse_args(parser(SERVE), ["/m", "--config", str(cfg)])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_config_file_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(parser(SERVE), ["/m", "--config", str(tmp_path / "none.yaml")])
    assert "argument --config: cannot read" in capsys.readouterr().err
