"""`jaxserve serve`'s flags (vLLM's names) and their parsing: the engine's flags
(jaxserve/config/engine_args.py), the server's own, and vLLM's flags for parts jaxserve does
not have (jaxserve/config/vllm_compat.py), each taken or refused by name."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Callable

from jaxserve.api.config_file import expand_config_file
from jaxserve.api.log_values import DEFAULT_MAX_LOG_LEN
from jaxserve.api.reasoning_parsers import REASONING_PARSERS
from jaxserve.api.tool_parsers import TOOL_PARSERS
from jaxserve.checkpoints.model_configs import ALIASES
from jaxserve.config.engine_args import (EnableDisableAction, add_engine_args, add_vllm_compat_args,
                                         check_vllm_compat, dashed)
from jaxserve.config.vllm_compat import ENGINE, FRONTEND

# generation_config.json fields that become default sampling values (as vLLM does).
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# What --override-generation-config may set: the request fields a default can stand in for.
OVERRIDABLE = (*GENERATION_DEFAULTS, "presence_penalty", "frequency_penalty")
_UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")
_MODEL_HELP = ("checkpoint directory, Hugging Face repo id (Org/Name: from the local HF "
               "cache, else downloaded) or alias (" + ", ".join(ALIASES) + "); with "
               "--load-format dummy an alias needs no files. Default: a built-in tiny random "
               "model (random text)")


def parser(prog: str = "python -m jaxserve.api") -> argparse.ArgumentParser:
    """The server's flags; prog "jaxserve serve" also takes the model as its first
    argument, as `vllm serve MODEL` does."""
    # (the usage line names no flag: there are some four hundred, vLLM's included)
    usage = f"{prog} [MODEL] [options]" if prog.endswith(" serve") else f"{prog} [options]"
    ap = argparse.ArgumentParser(prog=prog, usage=usage,
                                 description="OpenAI-compatible server for jaxserve.")
    a = ap.add_argument
    if prog.endswith(" serve"):
        a("model_tag", nargs="?", default=None, metavar="MODEL", help=_MODEL_HELP)
    _add_listening(a)
    # The engine's knobs: flags made from EngineConfig's fields (names, types, defaults).
    add_engine_args(ap)
    _add_generation(a)
    _add_logging(a)
    _add_http(a)
    _add_tools(a)
    a("--timeout-graceful-shutdown", "--shutdown-timeout", type=float, default=5.0,
      help="seconds in-flight requests get to finish on SIGTERM/SIGINT")
    add_vllm_compat_args(ap, ENGINE, "vLLM engine flags without a jaxserve knob")
    add_vllm_compat_args(ap, FRONTEND, "vLLM server flags without a jaxserve setting")
    return ap


def _add_listening(a: Callable[..., Any]) -> None:
    """The model, where the server listens, who may call it, and a multi-host run's
    processes."""
    a("--model", default=None, help=_MODEL_HELP)
    a("--config", default=None, metavar="FILE",
      help="a YAML file of flags (keys: flag names without the dashes); flags on the command "
           "line win")
    a("--served-model-name", nargs="+", default=None, metavar="NAME",
      help="the model names clients may use; answers carry the first (default: the model as "
           "given)")
    a("--host", default="127.0.0.1", help="address to listen on")
    a("--port", type=int, default=8000, help="port to listen on")
    a("--uds", default=None, metavar="PATH",
      help="listen on this Unix domain socket instead of --host/--port")
    a("--api-key", nargs="+", default=_env_keys(), metavar="KEY",
      help="require 'Authorization: Bearer KEY' with one of these keys (default: env "
           "JAXSERVE_API_KEY)")
    a("--coordinator-address", default=os.environ.get("JAXSERVE_COORDINATOR_ADDRESS"),
      help="multi-host: host:port of process 0's jax.distributed coordinator (default: env "
           "JAXSERVE_COORDINATOR_ADDRESS)")
    a("--num-processes", type=int, default=_env_int("JAXSERVE_NUM_PROCESSES"),
      help="multi-host: number of processes, one per host (env JAXSERVE_NUM_PROCESSES)")
    a("--process-id", type=int, default=_env_int("JAXSERVE_PROCESS_ID"),
      help="multi-host: this process's index; 0 serves HTTP (env JAXSERVE_PROCESS_ID)")


def _add_generation(a: Callable[..., Any]) -> None:
    """Chat templates, default sampling values, the tokenizer-info endpoint."""
    a("--chat-template", default=None, help="chat template file or string (default: the "
                                            "tokenizer's)")
    a("--default-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
      help="chat template variables for every request, under the request's own "
           "chat_template_kwargs, e.g. '{\"enable_thinking\": false}'")
    a("--generation-config", default="auto",
      help="'auto': default sampling values from the model's generation_config.json; "
           "'vllm': none; or a directory holding one")
    a("--override-generation-config", type=_json_object, default=None, metavar="JSON",
      help="default sampling values over --generation-config's, e.g. '{\"temperature\": 0.5}' "
           "(" + ", ".join(OVERRIDABLE) + ")")
    a("--enable-tokenizer-info-endpoint", action=EnableDisableAction, default=False,
      help="answer GET /tokenizer_info (the tokenizer's configuration and chat template), "
           "off by default as in vLLM")


def _add_logging(a: Callable[..., Any]) -> None:
    """What the server logs."""
    a("--disable-log-stats", action="store_true",
      help="do not log the engine's throughput, queue and KV cache usage every 10 s")
    a("--enable-log-requests", action=EnableDisableAction, default=True,
      help="log a line per request (its token counts and sampling settings, never its "
           "text); on by default in jaxserve")
    a("--max-log-len", type=int, default=DEFAULT_MAX_LOG_LEN,
      help="cut each value a request's log line shows (its sampling parameters) to this many "
           f"characters (default {DEFAULT_MAX_LOG_LEN}; vLLM's default is unbounded)")
    a("--log-level", default=None, choices=_LOG_LEVELS,
      help="level of jaxserve's log (default: INFO)")
    a("--uvicorn-log-level", default="info", choices=_UVICORN_LOG_LEVELS,
      help="log level of uvicorn (the HTTP server)")
    a("--disable-uvicorn-access-log", action=EnableDisableAction, default=False,
      help="no access log line per HTTP request")


def _add_http(a: Callable[..., Any]) -> None:
    """The HTTP server: docs, proxy path, CORS, TLS, limits on clients."""
    a("--disable-fastapi-docs", action=EnableDisableAction, default=False,
      help="no /docs, /redoc or /openapi.json")
    a("--root-path", default=None,
      help="the path prefix a proxy serves this server under (ASGI root_path)")
    a("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
      help="CORS: origins allowed, a JSON list (default: [\"*\"])")
    a("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
      help="CORS: methods allowed, a JSON list (default: [\"*\"])")
    a("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
      help="CORS: headers allowed, a JSON list (default: [\"*\"])")
    a("--allow-credentials", action=EnableDisableAction, default=False,
      help="CORS: allow credentials")
    a("--ssl-keyfile", default=None, help="serve HTTPS: the private key file")
    a("--ssl-certfile", default=None, help="serve HTTPS: the certificate file")
    a("--ssl-ca-certs", default=None, help="HTTPS: CA certificates to check clients against")
    a("--ssl-cert-reqs", type=int, default=0,
      help="HTTPS: whether client certificates are required (ssl.CERT_NONE=0, "
           "CERT_OPTIONAL=1, CERT_REQUIRED=2)")
    a("--ssl-ciphers", default=None, help="HTTPS: the cipher suites (TLS 1.2 and below), an "
                                          "OpenSSL cipher list (default: uvicorn's)")
    a("--h11-max-incomplete-event-size", type=int, default=4 * 2**20,
      help="largest HTTP header block (bytes) a client may send before it is complete")
    a("--max-waiting-requests", type=int, default=1024,
      help="answer 503 when more sequences than this are waiting (a request with n "
           "completions of k prompts is n*k sequences)")
    a("--max-request-body-bytes", type=int, default=32 * 2**20,
      help="answer 413 to request bodies larger than this (default 32 MiB)")


def _add_tools(a: Callable[..., Any]) -> None:
    """Tool calling and reasoning parsers."""
    a("--enable-auto-tool-choice", action=EnableDisableAction, default=False,
      help='let the model decide when to call tools (tool_choice "auto"): its output is '
           "read by --tool-call-parser")
    a("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
      help="the model's tool-call format, for --enable-auto-tool-choice (hermes: Qwen2.5/"
           "Qwen3, qwen3_coder: Qwen3-Coder/Qwen3.5/Qwen3.6, llama3_json, gemma4)")
    a("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
      help="split the model's <think> block into reasoning_content (qwen3, deepseek_r1)")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _env_keys() -> list[str] | None:
    key = os.environ.get("JAXSERVE_API_KEY")
    return [key] if key else None


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} (e.g. '[\"*\"]')") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """argv (default sys.argv[1:]) with its --config file's flags, checked: exits 2 naming
    the flag for a bad combination. args.vllm_notes: what the vLLM-only flags given mean
    here (for the start-up log)."""
    argv = dashed(sys.argv[1:] if argv is None else list(argv))
    argv = expand_config_file(ap, argv)
    args = ap.parse_args(argv)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            ap.error(f"the model is given twice: {tag!r} and --model {args.model!r}")
        args.model = tag
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        ap.error("--enable-auto-tool-choice and --tool-call-parser go together: the parser "
                 "reads the tool calls that auto tool choice lets the model make")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        ap.error("--ssl-keyfile and --ssl-certfile go together")
    if args.max_log_len < 1:
        ap.error(f"argument --max-log-len: must be >= 1, got {args.max_log_len}")
    if args.override_generation_config:
        unknown = sorted(set(args.override_generation_config) - set(OVERRIDABLE))
        if unknown:
            ap.error(f"argument --override-generation-config: {unknown[0]!r} cannot be "
                     f"overridden; the keys it takes: {', '.join(OVERRIDABLE)}")
    try:
        args.chat_template = chat_template(args.chat_template)
    except ValueError as e:
        ap.error(f"argument --chat-template: {e}")
    args.vllm_notes = check_vllm_compat(ap, args, {**ENGINE, **FRONTEND})
    return args


def chat_template(value: str | None) -> str | None:
    """The template: a file's text, or `value` itself when it is a Jinja template. Text
    with no Jinja in it is a path that does not exist: ValueError (a misspelt path must
    not become the template)."""
    if value is None:
        return None
    if os.path.isfile(os.path.expanduser(value)):
        with open(os.path.expanduser(value)) as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"{value!r} is neither a file nor a Jinja template ({{{{ ... }}}} or "
                     f"{{% ... %}})")


def log_level(args: argparse.Namespace) -> int:
    return getattr(logging, args.log_level or "INFO")
