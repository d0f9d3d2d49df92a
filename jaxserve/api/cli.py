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

import jaxserve
from jaxserve.api.loading import LoadingGate
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


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxserve.api",
                                 description="OpenAI-compatible server for jaxserve.")
    a = ap.add_argument
    a("--model", default=None,
      help="checkpoint directory, Hugging Face repo id (Org/Name, from the local HF cache; "
           "never downloaded) or alias (" + ", ".join(ALIASES) + "); with --load-format dummy "
           "an alias needs no files. Default: a built-in tiny random model (random text)")
    a("--served-model-name", default=None,
      help="model name clients use (default: --model as given)")
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
    a("--timeout-graceful-shutdown", type=float, default=5.0,
      help="seconds in-flight requests get to finish on SIGTERM/SIGINT")
    return ap


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


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
    if value is not None and os.path.isfile(value):
        with open(value) as f:
            return f.read()
    return value


def generation_defaults(setting: str, model_dir: str) -> dict:
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


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        ap.error("--enable-auto-tool-choice and --tool-call-parser go together: the parser "
                 "reads the tool calls that auto tool choice lets the model make")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if _multihost(args):
        from jaxserve.engine import multihost
        if multihost.initialize(args.coordinator_address, args.num_processes,
                                args.process_id) and not multihost.is_leader():
            # Hosts other than process 0 serve no HTTP: they run the steps process 0
            # publishes.
            from jaxserve.engine.data_parallel import make_engine
            make_engine(_checked_config(ap, args)).follow()
            return
    t0 = time.perf_counter()
    config = _checked_config(ap, args)
    try:   # alias / repo id -> directory here too: generation_config.json is read from it
        config = replace(config, model=resolve_model(config.model, load_format=config.load_format))
    except ValueError as e:
        parser().exit(2, f"error: {e}\n")
    served = args.served_model_name or (args.model or DEFAULT_MODEL_NAME)
    gate = LoadingGate(StartupProgress(), Metrics(served), jaxserve.__version__)
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
    server = _Server(uvicorn.Config(gate, host=args.host, port=args.port, log_level="info",
                                    timeout_graceful_shutdown=args.timeout_graceful_shutdown),
                     gate, on_listening=builder.start)
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


def _checked_config(ap: argparse.ArgumentParser, args: argparse.Namespace) -> EngineConfig:
    """engine_config, or exit 2 naming the flag whose value EngineConfig refuses."""
    try:
        return engine_config(args)
    except ConfigError as e:
        config_error(ap, e)


def _multihost(args: argparse.Namespace) -> bool:
    """Whether any multi-host setting is given (flags or their JAXSERVE_* env defaults)."""
    return any(v is not None for v in (args.coordinator_address, args.num_processes,
                                       args.process_id))


def _build_engine(args: argparse.Namespace, config: EngineConfig, served: str,
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
        served_model_name=served, max_model_len=info.max_model_len, api_key=args.api_key,
        max_waiting_requests=args.max_waiting_requests,
        disable_log_requests=args.disable_log_requests,
        chat_template=chat_template(args.chat_template),
        generation_defaults=generation_defaults(args.generation_config, config.model),
        max_request_body_bytes=args.max_request_body_bytes,
        auto_tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    gate.open(create_app(engine, settings, gate.metrics), engine)
    logger.info(
        "serving %s (%s) | mesh %s | dtype %s | weights %.1f MiB | KV cache %d pages = %d tokens "
        "| max concurrency at %d tokens: %.1f | warmup %d compilations (%d fresh, %d from the "
        "persistent compilation cache) in %.1f s | ready in %.1f s at http://%s:%d/v1", served,
        info.model_config.architecture, config.mesh or "1x1", info.dtype,
        info.weight_bytes / 2**20, info.num_pages - 1, info.kv_tokens, info.max_model_len,
        info.kv_tokens / info.max_model_len, info.warmup_compilations,
        info.warmup_fresh_compilations, info.warmup_cache_hits, info.warmup_seconds,
        time.perf_counter() - t0, args.host, args.port)


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
