"""`python -m jaxserve.api`: command-line flags (vLLM's names) -> engine + server."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
import time
from dataclasses import replace

import uvicorn
from starlette.middleware.cors import CORSMiddleware

import jaxserve
from jaxserve.api.config_file import expand_config_file
from jaxserve.api.loading import LoadingGate
from jaxserve.api.log_values import DEFAULT_MAX_LOG_LEN
from jaxserve.api.reasoning_parsers import REASONING_PARSERS
from jaxserve.api.tool_parsers import TOOL_PARSERS
from jaxserve.api.metrics import Metrics
from jaxserve.config import ConfigError, EngineConfig
from jaxserve.engine_args import add_engine_args, config_error, engine_kwargs
from jaxserve.checkpoints.default_model import DEFAULT_MODEL_NAME, default_model_dir
from jaxserve.engine.startup import STARTING, StartupProgress
from jaxserve.checkpoints.model_configs import ALIASES
from jaxserve.checkpoints.model_names import resolve_model

logger = logging.getLogger("jaxserve")

# generation_config.json fields that become default sampling values (as vLLM does).
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# What --override-generation-config may set: the request fields a default can stand in for.
_OVERRIDABLE = (*_GENERATION_DEFAULTS, "presence_penalty", "frequency_penalty")
_UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_MODEL_HELP = ("checkpoint directory, Hugging Face repo id (Org/Name: from the local HF "
               "cache, else downloaded) or alias (" + ", ".join(ALIASES) + "); with "
               "--load-format dummy an alias needs no files. Default: a built-in tiny random "
               "model (random text)")


def parser(prog: str = "python -m jaxserve.api") -> argparse.ArgumentParser:
    """The server's flags; prog "jaxserve serve" also takes the model as its first
    argument, as `vllm serve MODEL` does."""
    ap = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible server for jaxserve.")
    a = ap.add_argument
    if prog.endswith(" serve"):
        a("model_tag", nargs="?", default=None, metavar="MODEL", help=_MODEL_HELP)
    a("--model", default=None, help=_MODEL_HELP)
    a("--config", default=None, metavar="FILE",
      help="a YAML file of flags (keys: flag names without the dashes); flags on the command "
           "line win")
    a("--served-model-name", nargs="+", default=None, metavar="NAME",
      help="the model names clients may use; answers carry the first (default: the model as "
           "given)")
    a("--host", default="127.0.0.1", help="address to listen on")
    a("--port", type=int, default=8000, help="port to listen on")
    a("--api-key", default=os.environ.get("JAXSERVE_API_KEY"),
      help="require 'Authorization: Bearer KEY' (default: env JAXSERVE_API_KEY)")
    a("--coordinator-address", default=os.environ.get("JAXSERVE_COORDINATOR_ADDRESS"),
      help="multi-host: host:port of process 0's jax.distributed coordinator (default: env "
           "JAXSERVE_COORDINATOR_ADDRESS)")
    a("--num-processes", type=int, default=_env_int("JAXSERVE_NUM_PROCESSES"),
      help="multi-host: number of processes, one per host (env JAXSERVE_NUM_PROCESSES)")
    a("--process-id", type=int, default=_env_int("JAXSERVE_PROCESS_ID"),
      help="multi-host: this process's index; 0 serves HTTP (env JAXSERVE_PROCESS_ID)")
    # The engine's knobs: flags made from EngineConfig's fields (names, types, defaults).
    add_engine_args(ap)
    a("--chat-template", default=None, help="chat template file or string (default: the "
                                            "tokenizer's)")
    a("--generation-config", default="auto",
      help="'auto': default sampling values from the model's generation_config.json; "
           "'vllm': none; or a directory holding one")
    a("--override-generation-config", type=_json_object, default=None, metavar="JSON",
      help="default sampling values over --generation-config's, e.g. '{\"temperature\": 0.5}' "
           "(" + ", ".join(_OVERRIDABLE) + ")")
    a("--enable-tokenizer-info-endpoint", action="store_true",
      help="answer GET /tokenizer_info (the tokenizer's configuration and chat template), "
           "off by default as in vLLM")
    a("--disable-log-stats", action="store_true",
      help="do not log the engine's throughput, queue and KV cache usage every 10 s")
    a("--uvicorn-log-level", default="info", choices=_UVICORN_LOG_LEVELS,
      help="log level of uvicorn (the HTTP server)")
    a("--root-path", default=None,
      help="the path prefix a proxy serves this server under (ASGI root_path)")
    a("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
      help="CORS: origins allowed, a JSON list (default: [\"*\"])")
    a("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
      help="CORS: methods allowed, a JSON list (default: [\"*\"])")
    a("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
      help="CORS: headers allowed, a JSON list (default: [\"*\"])")
    a("--allow-credentials", action="store_true", help="CORS: allow credentials")
    a("--ssl-keyfile", default=None, help="serve HTTPS: the private key file")
    a("--ssl-certfile", default=None, help="serve HTTPS: the certificate file")
    a("--ssl-ca-certs", default=None, help="HTTPS: CA certificates to check clients against")
    a("--ssl-cert-reqs", type=int, default=0,
      help="HTTPS: whether client certificates are required (ssl.CERT_NONE=0, "
           "CERT_OPTIONAL=1, CERT_REQUIRED=2)")
    a("--max-waiting-requests", type=int, default=1024,
      help="answer 503 when more sequences than this are waiting (a request with n "
           "completions of k prompts is n*k sequences)")
    a("--max-request-body-bytes", type=int, default=32 * 2**20,
      help="answer 413 to request bodies larger than this (default 32 MiB)")
    a("--enable-auto-tool-choice", action="store_true",
      help='let the model decide when to call tools (tool_choice "auto"): its output is '
           "read by --tool-call-parser")
    a("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
      help="the model's tool-call format, for --enable-auto-tool-choice (hermes: Qwen2.5/"
           "Qwen3, qwen3_coder: Qwen3-Coder/Qwen3.5/Qwen3.6, llama3_json, gemma4)")
    a("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
      help="split the model's <think> block into reasoning_content (qwen3, deepseek_r1)")
    a("--disable-log-requests", action="store_true", help="do not log each request")
    a("--max-log-len", type=int, default=DEFAULT_MAX_LOG_LEN,
      help="cut each value a request's log line shows (its sampling parameters) to this many "
           f"characters (default {DEFAULT_MAX_LOG_LEN}; vLLM's default is unbounded)")
    a("--timeout-graceful-shutdown", type=float, default=5.0,
      help="seconds in-flight requests get to finish on SIGTERM/SIGINT")
    return ap


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


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
    the flag for a bad combination."""
    argv = expand_config_file(ap, sys.argv[1:] if argv is None else list(argv))
    args = ap.parse_args(argv)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            ap.error(f"the model is given twice: {tag!r} and --model {args.model!r}")
        args.model = tag
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        ap.error("--enable-auto-tool-choice and --tool-call-parser go together: the parser "
                 "reads the tool calls that auto tool choice lets the model make")
    if args.max_log_len < 1:
        ap.error(f"argument --max-log-len: must be >= 1, got {args.max_log_len}")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        ap.error("--ssl-keyfile and --ssl-certfile go together")
    if args.override_generation_config:
        unknown = sorted(set(args.override_generation_config) - set(_OVERRIDABLE))
        if unknown:
            ap.error(f"argument --override-generation-config: {unknown[0]!r} cannot be "
                     f"overridden; the keys it takes: {', '.join(_OVERRIDABLE)}")
    try:
        args.chat_template = chat_template(args.chat_template)
    except ValueError as e:
        ap.error(f"argument --chat-template: {e}")
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """ConfigError (a ValueError naming the field) for a bad value."""
    kwargs = engine_kwargs(args)
    model = args.model
    if model is None:
        model, kwargs["load_format"] = default_model_dir(), "dummy"
        logger.warning("no --model given: serving the built-in %s, a tiny model with RANDOM "
                       "weights (its output is random text). Serve a real checkpoint with "
                       "--model /path/to/hf-checkpoint", DEFAULT_MODEL_NAME)
    return EngineConfig(model=model, **kwargs)


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


def generation_defaults(setting: str, model_dir: str, override: dict | None = None) -> dict:
    """Default sampling values: the model's generation_config.json ("auto"), none
    ("vllm"), or a directory's; `override` (--override-generation-config) on top."""
    defaults = _generation_config(setting, model_dir)
    if override:
        defaults = {**defaults, **override}
        logger.info("default sampling values with --override-generation-config: %s", defaults)
    return defaults


def _generation_config(setting: str, model_dir: str) -> dict:
    if setting == "vllm":
        return {}
    path = os.path.join(model_dir if setting == "auto" else setting, "generation_config.json")
    if not os.path.isfile(path):
        if setting != "auto":
            raise ValueError(f"--generation-config {setting!r}: no generation_config.json there")
        return {}
    with open(path) as f:
        cfg = json.load(f)
    defaults = {k: cfg[k] for k in _GENERATION_DEFAULTS if cfg.get(k) is not None}
    if defaults:
        logger.info("default sampling values from %s: %s", path, defaults)
    return defaults


def main(argv: list[str] | None = None, prog: str = "python -m jaxserve.api") -> None:
    ap = parser(prog)
    args = parse_args(ap, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if _multihost(args):
        from jaxserve.engine import multihost
        if multihost.initialize(args.coordinator_address, args.num_processes,
                                args.process_id) and not multihost.is_leader():
            # Hosts other than process 0 serve no HTTP: they run the steps process 0
            # publishes.
            from jaxserve.engine.data_parallel import make_engine
            make_engine(checked_config(ap, args)).follow()
            return
    t0 = time.perf_counter()
    config = checked_config(ap, args)
    try:   # alias / repo id -> directory here too: generation_config.json is read from it
        config = replace(config, model=resolve_model(
            config.model, load_format=config.load_format, revision=config.revision,
            download_dir=config.download_dir))
    except ValueError as e:
        parser().exit(2, f"error: {e}\n")
    served = tuple(args.served_model_name or [args.model or DEFAULT_MODEL_NAME])
    spec = config.speculative_config   # its counters are there from the start, as vLLM's
    gate = LoadingGate(StartupProgress(), Metrics(
        served[0], num_speculative_tokens=spec.num_speculative_tokens if spec else 0),
        jaxserve.__version__)
    fatal: list[BaseException] = []

    def stop(error: BaseException, what: str, traceback: bool) -> None:
        # The engine could not be built, or its thread cannot go on: stop serving and
        # exit non-zero (below), so a supervisor restarts the server instead of it
        # answering 503 for ever.
        fatal.append(error)
        logger.critical("%s (%s: %s); the server exits with status 1", what,
                        type(error).__name__, error, exc_info=error if traceback else None)
        server.should_exit = True

    def build() -> None:
        logger.info("building the engine while the server listens (GET /health answers 503 "
                    "with its progress, 200 once ready)")
        try:   # (the engine thread logged the traceback of an error that stops it)
            _build_engine(args, config, served, gate, t0,
                          on_fatal=lambda e: stop(e, "the engine stopped", False))
        except BaseException as e:   # noqa: BLE001 - reported, and the process exits 1
            gate.fail(e)
            stop(e, "the engine failed to start", True)

    builder = threading.Thread(target=build, name="jaxserve-startup", daemon=True)
    server = _Server(_uvicorn_config(args, gate), gate, on_listening=builder.start)
    server.run()
    if builder.is_alive():
        # Stopped while the engine was still loading: an XLA compilation or a weight read
        # cannot be interrupted, and a Python exit with it running in a thread may hang
        # or crash in native code, so leave without waiting for it.
        logger.info("stopped before the engine was ready")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if fatal else 0)
    if fatal:
        sys.exit(1)


def checked_config(ap: argparse.ArgumentParser, args: argparse.Namespace) -> EngineConfig:
    """engine_config, or exit 2 naming the flag whose value EngineConfig refuses."""
    try:
        return engine_config(args)
    except ConfigError as e:
        config_error(ap, e)


def _multihost(args: argparse.Namespace) -> bool:
    """Whether any multi-host setting is given (flags or their JAXSERVE_* env defaults)."""
    return any(v is not None for v in (args.coordinator_address, args.num_processes,
                                       args.process_id))


def _uvicorn_config(args: argparse.Namespace, gate: LoadingGate) -> uvicorn.Config:
    """HTTP(S) on the gate, which answers while the engine loads, behind CORS (vLLM's
    defaults: any origin, method and header)."""
    app = CORSMiddleware(gate, allow_origins=args.allowed_origins,
                         allow_methods=args.allowed_methods, allow_headers=args.allowed_headers,
                         allow_credentials=args.allow_credentials)
    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                          timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                          root_path=args.root_path or "", ssl_keyfile=args.ssl_keyfile,
                          ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                          ssl_cert_reqs=args.ssl_cert_reqs)


def _build_engine(args: argparse.Namespace, config: EngineConfig, served: tuple[str, ...],
                  gate: LoadingGate, t0: float, on_fatal) -> None:
    """The startup thread: the engine, then the app, then the gate opens."""
    gate.progress.set_phase(STARTING, "importing the engine")
    from jaxserve.api.server import create_app
    from jaxserve.api.serving import ServerSettings
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.planning.plan import plan_for_engine

    engine = AsyncEngine(config, on_fatal=on_fatal, progress=gate.progress)
    info = engine.info
    logger.info("%s", plan_for_engine(info))
    settings = ServerSettings(
        served_model_names=served, max_model_len=info.max_model_len, api_key=args.api_key,
        max_waiting_requests=args.max_waiting_requests,
        disable_log_requests=args.disable_log_requests,
        chat_template=args.chat_template, disable_log_stats=args.disable_log_stats,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        generation_defaults=generation_defaults(args.generation_config, config.model,
                                                args.override_generation_config),
        max_request_body_bytes=args.max_request_body_bytes, max_log_len=args.max_log_len,
        auto_tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    gate.open(create_app(engine, settings, gate.metrics), engine)
    logger.info(
        "serving %s (%s) | mesh %s | dtype %s | weights %.1f MiB | KV cache %d pages = %d tokens "
        "| max concurrency at %d tokens: %.1f | warmup %d compilations (%d fresh, %d from the "
        "persistent compilation cache) in %.1f s | ready in %.1f s at %s://%s:%d%s/v1",
        ", ".join(served),
        info.model_config.architecture, config.mesh or "1x1", info.dtype,
        info.weight_bytes / 2**20, info.num_pages - 1, info.kv_tokens, info.max_model_len,
        info.kv_tokens / info.max_model_len, info.warmup_compilations,
        info.warmup_fresh_compilations, info.warmup_cache_hits, info.warmup_seconds,
        time.perf_counter() - t0, "https" if args.ssl_certfile else "http", args.host,
        args.port, args.root_path or "")


class _Server(uvicorn.Server):
    """Exits 0 after a graceful SIGTERM/SIGINT shutdown (uvicorn would re-raise the
    signal once done, making the exit status 128+signal). Answers still running
    shortly before the grace period ends are ended with a 503 (a stream with an
    error event and [DONE]) rather than cut off mid-stream by uvicorn."""

    def __init__(self, config: uvicorn.Config, gate: LoadingGate, on_listening):
        """on_listening: called once the port is bound (starts building the engine)."""
        super().__init__(config)
        self.gate = gate
        self.on_listening = on_listening

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)   # (a port it cannot bind: uvicorn exits 1 here)
        if not self.should_exit:   # no SIGTERM came meanwhile
            self.on_listening()

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    async def shutdown(self, sockets=None) -> None:
        grace = self.config.timeout_graceful_shutdown
        timer = None
        serving = self.gate.serving   # None: still loading, no answer is in progress
        # grace None: uvicorn waits for ever, so nothing is ever cut.
        if grace is not None and serving is not None:
            # Leave the answers a moment (up to 1 s) to send their last event.
            timer = asyncio.get_running_loop().call_later(
                grace - min(1.0, grace / 2), serving.end_all_answers)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()
