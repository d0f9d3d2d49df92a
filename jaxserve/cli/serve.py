"""`python -m jaxserve.api` / `jaxserve serve`: flags (cli/serve_args.py) -> engine + server."""
from __future__ import annotations

import argparse
import asyncio
import gc
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
from jaxserve.cli.serve_args import GENERATION_DEFAULTS, log_level, parse_args, parser
from jaxserve.api.loading import LoadingGate
from jaxserve.api.metrics import Metrics
from jaxserve.config import EngineConfig
from jaxserve.config.engine_args import config_error, engine_kwargs
from jaxserve.checkpoints.default_model import DEFAULT_MODEL_NAME, default_model_dir
from jaxserve.build.startup import STARTING, StartupProgress
from jaxserve.checkpoints.model_names import resolve_model
from jaxserve.errors import ConfigError

logger = logging.getLogger("jaxserve")

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
    defaults = {k: cfg[k] for k in GENERATION_DEFAULTS if cfg.get(k) is not None}
    if defaults:
        logger.info("default sampling values from %s: %s", path, defaults)
    return defaults


def main(argv: list[str] | None = None, prog: str = "python -m jaxserve.api") -> None:
    ap = parser(prog)
    args = parse_args(ap, argv)
    logging.basicConfig(level=log_level(args), format="%(asctime)s %(levelname)s %(message)s")
    for note in args.vllm_notes:
        logger.info("%s", note)
    if _multihost(args):
        # (jax.distributed starts first: size JAX's GPU pool before it, as make_engine does)
        from jaxserve.build.device_pool import set_device_pool
        from jaxserve.build.gpu_xla_flags import quantized_weights, set_gpu_xla_flags
        set_device_pool(args.hbm_utilization)
        set_gpu_xla_flags(quantized_weights(args.quantization, args.model))   # (logged later)
        from jaxserve.engine import multihost   # (imports jax: after the pool is sized)
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
    tls = {"ssl_ciphers": args.ssl_ciphers} if args.ssl_ciphers else {}
    return uvicorn.Config(app, host=args.host, port=args.port, uds=args.uds,
                          log_level=args.uvicorn_log_level,
                          access_log=not args.disable_uvicorn_access_log,
                          h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                          timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                          root_path=args.root_path or "", ssl_keyfile=args.ssl_keyfile,
                          ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                          ssl_cert_reqs=args.ssl_cert_reqs, **tls)


def _build_engine(args: argparse.Namespace, config: EngineConfig, served: tuple[str, ...],
                  gate: LoadingGate, t0: float, on_fatal) -> None:
    """The startup thread: the engine, then the app, then the gate opens."""
    gate.progress.set_phase(STARTING, "importing the engine")
    # (the engine and jax load here, in the startup thread, once the server listens and
    # JAX's GPU pool is sized: /health answers while they load)
    from jaxserve.api.server import create_app
    from jaxserve.api.settings import ServerSettings
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.planning.plan import plan_for_engine

    engine = AsyncEngine(config, on_fatal=on_fatal, progress=gate.progress)
    info = engine.info
    logger.info("%s", plan_for_engine(info))
    settings = ServerSettings(
        served_model_names=served, max_model_len=info.max_model_len,
        api_key=tuple(args.api_key or ()), max_waiting_requests=args.max_waiting_requests,
        disable_log_requests=not args.enable_log_requests,
        default_chat_template_kwargs=args.default_chat_template_kwargs or {},
        disable_fastapi_docs=args.disable_fastapi_docs,
        chat_template=args.chat_template, disable_log_stats=args.disable_log_stats,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        generation_defaults=generation_defaults(args.generation_config, config.model,
                                                args.override_generation_config),
        max_request_body_bytes=args.max_request_body_bytes, max_log_len=args.max_log_len,
        auto_tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    # Start-up's objects (modules, traced programs, the model's Python side) live as long as
    # the server: frozen out of Python's cyclic GC, whose full collections would walk them
    # all, a stall of the step loop (one took 739 ms over 640k objects after a run of the
    # CPU benchmark's llama). A server holds one engine, so nothing frozen is dropped later
    # (in-process LLM users may build several: not done for them).
    gc.collect()
    gc.freeze()
    logger.info("startup: %d objects frozen out of the garbage collector", gc.get_freeze_count())
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
