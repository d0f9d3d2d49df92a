"""vLLM's `vllm serve` flags on `jaxserve serve`: each parses to the EngineConfig (or
server setting) it means, or exits 2 with a message naming the flag and the reason."""
from __future__ import annotations

import json

import pytest

from jaxserve.cli.serve import checked_config, engine_config, parse_args, parser
from jaxserve.config import EngineConfig
from jaxserve.config.engine_args import human_readable_int
from jaxserve.config.vllm_compat import ENGINE, FRONTEND
from jaxserve.lora_request import LoRARequest
from tests.api.vllm_serve_flags import NO, NOOP, OLDER_VLLM_FLAGS, VLLM_SERVE_FLAGS, WORKS

SERVE = "jaxserve serve"
ALL_FLAGS = {**VLLM_SERVE_FLAGS, **OLDER_VLLM_FLAGS}


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
    (["--async-scheduling"], {"async_scheduling": True}),
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
    (["-pp", "2"], "argument --pipeline-parallel-size/-pp: pipeline_parallel_size=2: jaxserve "
                   "has no pipeline parallelism"),
    (["--swap-space", "4"], "argument --swap-space: swap_space=4.0: jaxserve never swaps"),
    (["--preemption-mode", "swap"], "argument --preemption-mode: preemption_mode='swap': "
                                    "jaxserve preempts by recomputation only"),
    (["--no-enable-chunked-prefill"], "argument --enable-chunked-prefill/--no-enable-chunked-"
                                      "prefill/--disable-chunked-prefill: "
                                      "enable_chunked_prefill=False: chunked prefill is always on"),
    (["--mesh", "1x4", "-tp", "2"], "argument --tensor-parallel-size/-tp: tensor_parallel_size"
                                    "=2: disagrees with mesh='1x4'"),
    (["-tp", "0"], "argument --tensor-parallel-size/-tp: tensor_parallel_size=0: must be >= 1"),
    (["--gpu-memory-utilization", "1.5"], "argument --hbm-utilization/--gpu-memory-utilization/"
                                          "--device-memory-utilization: hbm_utilization=1.5: "
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
    from jaxserve.cli.serve import generation_defaults
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


# ---- every flag of `vllm serve --help` (tests/api/vllm_serve_flags.py) ---------------------
def _spellings() -> dict[str, object]:
    return {opt: a for a in parser(SERVE)._actions for opt in a.option_strings}


def _compat(action) -> bool:
    """Whether the flag is one of vLLM's without a jaxserve knob (jaxserve/config/vllm_compat.py)."""
    return action.dest.startswith("vllm_compat:")


@pytest.mark.parametrize("name", sorted(ALL_FLAGS))
def test_every_vllm_flag_is_known(name):
    """Each spelling vLLM takes is a flag of `jaxserve serve` (never "unrecognized
    arguments"); what the list says works is a jaxserve setting, not a compat entry."""
    flag, known = ALL_FLAGS[name], _spellings()
    if not flag.spellings:   # vllm serve MODEL
        assert any(a.dest == "model_tag" for a in parser(SERVE)._actions)
        return
    missing = [s for s in flag.spellings if s not in known]
    assert not missing, f"{name}: jaxserve serve does not know {missing} ({flag.does})"
    compat = {_compat(known[s]) for s in flag.spellings}
    if flag.does == WORKS:
        assert compat == {False}, f"{name} is listed as working but is only a compat entry"
    if flag.does in (NOOP, NO):
        assert compat == {True}, name


@pytest.mark.parametrize("name", sorted(n for n, f in ALL_FLAGS.items() if f.ok is not None))
def test_vllm_flag_values_jaxserve_takes(name):
    """A value that works (or is true of jaxserve) starts the parse; a compat flag's is
    said in the start-up log (args.vllm_notes), never taken silently."""
    flag = ALL_FLAGS[name]
    ap = parser(SERVE)
    args = parse_args(ap, ["/m", *flag.ok])
    checked_config(ap, args)
    given = [s for s in flag.spellings if s in flag.ok]
    if given and _compat(_spellings()[given[0]]):
        assert any(note.startswith(flag.spellings[0]) for note in args.vllm_notes), \
            args.vllm_notes


@pytest.mark.parametrize("name", sorted(n for n, f in ALL_FLAGS.items()
                                        if f.refused is not None))
def test_vllm_flag_values_jaxserve_refuses_exit_2_naming_the_flag(name, capsys):
    flag = ALL_FLAGS[name]
    with pytest.raises(SystemExit) as e:
        config_of(*flag.refused)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "unrecognized arguments" not in err, err
    said = err.split("error:", 1)[1]   # (not the usage line)
    assert any(s in said for s in flag.spellings), err


def test_the_list_covers_every_compat_entry():
    """jaxserve's compat table holds vLLM's names only: each is in the list."""
    listed = {s for f in ALL_FLAGS.values() for s in f.spellings}
    for name in {**ENGINE, **FRONTEND}:
        assert "--" + name.replace("_", "-") in listed, name


@pytest.mark.parametrize("text, value", [
    ("4096", 4096), ("32k", 32_000), ("32K", 32_768), ("1.5m", 1_500_000), ("2M", 2 * 2**20),
    ("4g", 4 * 10**9), ("4G", 4 * 2**30), ("1T", 2**40), (" 8k ", 8000)])
def test_sizes_read_as_vllm_reads_them(text, value):
    """Lower-case suffixes are decimal, upper-case binary (vLLM's human_readable_int)."""
    assert human_readable_int(text) == value


@pytest.mark.parametrize("argv, expected", [
    (["--max-model-len", "32k"], {"max_model_len": 32_000}),
    (["--max-model-len", "32K"], {"max_model_len": 32_768}),
    (["--max-model-len", "auto"], {"max_model_len": None}),
    (["--max-model-len", "-1"], {"max_model_len": None}),
    (["--max-num-batched-tokens", "8K"], {"max_num_batched_tokens": 8192}),
    (["--kv-cache-memory-bytes", "6G"], {"kv_cache_memory_bytes": 6 * 2**30}),
    (["--num-gpu-blocks-override", "1000"], {"num_pages": 1000}),
    (["--device-memory-utilization", "0.7"], {"hbm_utilization": 0.7}),
    (["--max_model_len", "2k", "--max_num_seqs=8"], {"max_model_len": 2000, "max_num_seqs": 8}),
    (["--disable-prefix-caching"], {"enable_prefix_caching": False}),
    (["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", "a=/x",
      '{"name": "b", "path": "/y", "base_model_name": "m"}'],
     {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
      "lora_modules": (LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/y", "m"))}),
    (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
    (["-sc", '{"method": "ngram", "num_speculative_tokens": 2}'],
     {"speculative_config.num_speculative_tokens": 2}),
    (["--spec-method", "ngram", "--spec-tokens", "5"],
     {"speculative_config.method": "ngram", "speculative_config.num_speculative_tokens": 5}),
    (["--spec-model", "/draft"], {"speculative_config.method": "draft_model",
                                  "speculative_config.model": "/draft"}),
])
def test_vllm_spellings_reach_the_engine_config(argv, expected):
    cfg = config_of(*argv)
    got = {}
    for key in expected:
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        got[key] = obj
    assert got == expected


@pytest.mark.parametrize("argv, message", [
    (["--max-model-len", "1.5K"], "argument --max-model-len: invalid size '1.5K': K is binary"),
    (["--max-model-len", "32 k"], "argument --max-model-len: invalid size '32 k'"),
    (["--spec-method", "ngram", "--speculative-config", '{"method": "ngram"}'],
     "argument --speculative-config/-sc: give --speculative-config or its shorthands"),
    (["--tokenizer-mode", "mistral"], "argument --tokenizer-mode: 'mistral' is not supported by "
                                      "jaxserve: the tokenizer is the checkpoint's"),
    (["--limit-mm-per-prompt", '{"audio": 4}'], "argument --limit-mm-per-prompt: "
                                                "limit_mm_per_prompt['audio']=4: video and "
                                                "audio inputs are not served"),
    (["--max-num-partial-prefills", "4"], "argument --max-num-partial-prefills: 4 is not "
                                          "supported by jaxserve"),
    (["--lora-target-modules", "q_proj"], "argument --lora-target-modules: ['q_proj'] is not "
                                          "supported by jaxserve: each adapter's own"),
    (["--max-loras", "2", "--max-cpu-loras", "1"], "argument --max-cpu-loras: max_cpu_loras=1: "
                                                   "must be an int >= max_loras (2)"),
    (["--lora-modules", "a=/x"], "argument --lora-modules: lora_modules: adapters are "
                                  "served only with --enable-lora"),
    (["--api-server-count", "x"], "argument --api-server-count/-asc: invalid int value: 'x'"),
    (["--hf-overrides", "{"], "argument --hf-overrides: not JSON: '{'"),
])
def test_vllm_flag_refusals_say_why(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        config_of(*argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_log_requests_and_api_keys():
    args = parse_args(parser(SERVE), ["/m", "--api-key", "k1", "k2", "--disable-log-requests"])
    assert args.api_key == ["k1", "k2"] and args.enable_log_requests is False
    defaults = parse_args(parser(SERVE), ["/m", "--enable-log-requests"])
    assert defaults.enable_log_requests is True
    assert parse_args(parser(SERVE), ["/m"]).enable_log_requests is True   # jaxserve's default


def test_server_flags_reach_uvicorn_and_the_log():
    import logging

    from jaxserve.cli.serve import _uvicorn_config, log_level
    args = parse_args(parser(SERVE), [
        "/m", "--uds", "/tmp/jaxserve.sock", "--disable-uvicorn-access-log", "--ssl-ciphers",
        "ECDHE-RSA-AES256-GCM-SHA384", "--h11-max-incomplete-event-size", "1024",
        "--shutdown-timeout", "30", "--log-level", "DEBUG"])
    cfg = _uvicorn_config(args, gate=None)
    assert (cfg.uds, cfg.access_log, cfg.ssl_ciphers, cfg.h11_max_incomplete_event_size,
            cfg.timeout_graceful_shutdown) == ("/tmp/jaxserve.sock", False,
                                               "ECDHE-RSA-AES256-GCM-SHA384", 1024, 30.0)
    assert log_level(args) == logging.DEBUG
    plain = _uvicorn_config(parse_args(parser(SERVE), ["/m"]), gate=None)
    assert (plain.uds, plain.access_log, plain.timeout_graceful_shutdown) == (None, True, 5.0)
