"""AsyncEngine: one engine thread drives an Engine; each request gets its own stream.

The engine thread owns the Engine (an EngineCore, or the DataParallelEngine for a
"DxM" mesh with D > 1): nothing else touches it. Callers check their requests at
the front door first (`inputs`, from any thread), then submit them through a
queue; the thread runs steps while work remains and delivers each request's
delta outputs to the asyncio queue of its caller.
A caller that goes away (client disconnect, cancellation) aborts its request,
which frees its pages at the next step boundary.

Failures: a request the engine fails (its step raised, or adding it raised) reaches
its caller as RequestFailedError, and the engine goes on. Anything else that goes
wrong in the engine thread (EngineDeadError from the core, a failed abort or
statistics snapshot, a bug in this loop) is fatal: every caller gets
EngineDeadError, `dead` becomes True, and `on_fatal` is called once so that the
server can exit and be restarted.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, fields, replace
from typing import Any, AsyncIterator, Callable

from jaxserve.config import EngineConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.scheduler import SchedulerStats
from jaxserve.engine.data_parallel import make_engine
from jaxserve.errors import EngineDeadError, InputError, RequestFailedError
from jaxserve.engine.input_processor import EngineRequest, InputProcessor
from jaxserve.engine.protocol import Engine, EngineInfo
from jaxserve.build.startup import StartupProgress

logger = logging.getLogger("jaxserve")


@dataclass(frozen=True, slots=True)
class EngineStats(SchedulerStats):
    """A snapshot the engine thread publishes after every step (read by /metrics): the
    scheduler's counts and the engine's compilations."""
    num_compilations: int = 0

    @staticmethod
    def of(s: SchedulerStats, num_compilations: int) -> EngineStats:
        return EngineStats(**{f.name: getattr(s, f.name) for f in fields(SchedulerStats)},
                           num_compilations=num_compilations)


__all__ = ["AsyncEngine", "EngineDeadError", "EngineStats", "RequestFailedError"]


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, core: Engine | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 progress: StartupProgress | None = None):
        """core: the engine to drive (default: make_engine(config)); only the engine
        thread touches it after this. on_fatal: called once, from the engine thread,
        with the error that stopped the engine (after every caller has been failed).
        progress: follows the engine's construction (see make_engine)."""
        self.core: Engine = core or make_engine(config, stream_outputs=True, progress=progress)
        self.config = config
        # Safe from any thread: the facts are frozen, the processor keeps no engine state.
        self.info: EngineInfo = self.core.info
        self.inputs: InputProcessor = self.core.inputs
        self.tokenizer = self.core.tokenizer
        self.stats = EngineStats()
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Callers awaiting an engine-thread operation (reset_prefix_cache): failed with
        # the engine, so none waits for ever.
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self._on_fatal = on_fatal
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any thread / event loop) --------------------------------------
    @property
    def dead(self) -> bool:
        """True once the engine thread has stopped, whatever the reason (a fatal error,
        shutdown): no request will be served."""
        return self._error is not None or not self._thread.is_alive()

    @property
    def num_pending(self) -> int:
        """Requests submitted and not finished (waiting + running + not yet added)."""
        return len(self._streams)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Streams the outputs of a request from `inputs.process` as its
        SamplingParams.output_kind asks (CUMULATIVE: all so far after each step; DELTA:
        what is new; FINAL_ONLY: the last alone; an engine made without stream_outputs,
        LLM's, sends final outputs only); the last one has finished=True."""
        if request.arrival_time is None:   # it arrives now, not when the busy engine thread
            request = replace(request, arrival_time=time.monotonic())   # gets to it
        request_id = request.request_id
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:   # under the lock: a dying engine fails every stream it sees
            if self.dead or self._stopping.is_set():
                raise self._dead_error()
            if request_id in self._streams:
                raise InputError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, stream)
        self._commands.put(("add", request))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def reset_prefix_cache(self) -> None:
        """Forgets every cached prompt page (as LLM.reset_prefix_cache), in the engine
        thread between two steps: the scheduler is that thread's alone. Returns once done;
        EngineDeadError when the engine is not running."""
        await self._in_engine_thread("reset_prefix_cache")

    async def remove_lora(self, lora_int_id: int) -> None:
        """Unloads a LoRA adapter (EngineCore.remove_lora), in the engine thread;
        ValueError while a request uses it."""
        await self._in_engine_thread("remove_lora", lora_int_id)

    async def _in_engine_thread(self, command: str, *args: Any) -> None:
        loop = asyncio.get_running_loop()
        waiter = (loop, loop.create_future())
        with self._lock:
            if self.dead or self._stopping.is_set():
                raise self._dead_error()
            self._waiters.add(waiter)
        self._commands.put((command, waiter, *args))
        await waiter[1]

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the engine thread."""
        self._stopping.set()
        self._commands.put(("stop",))
        self._thread.join(timeout)
        self.core.shutdown()

    # ---- engine thread ----------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
            if entry is not None and (isinstance(item, BaseException) or item.finished):
                del self._streams[request_id]
        if entry is not None:
            loop, stream = entry
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:   # the caller's loop is closed
                pass

    def _handle(self, cmd: tuple) -> None:
        core = self.core
        if cmd[0] == "add":
            request: EngineRequest = cmd[1]
            rid = request.request_id
            try:
                core.add_request(request)
            except ValueError as e:   # refused (an id in use): this request only
                self._deliver(rid, e)
            except EngineDeadError:
                raise
            except Exception as e:   # the core undid the add: only this request fails
                logger.exception("adding request %r failed", rid)
                self._deliver(rid, RequestFailedError(rid, f"{type(e).__name__}: {e}"))
        elif cmd[0] == "abort":
            out = core.abort_request(cmd[1])
            if out is not None:
                self._deliver(cmd[1], out)
        elif cmd[0] == "reset_prefix_cache":
            core.reset_prefix_cache()   # a failure here is the engine's: fatal
            self._resolve(cmd[1], None)
        elif cmd[0] == "remove_lora":
            try:
                core.remove_lora(cmd[2])
            except ValueError as e:   # in use: refused, the engine goes on
                self._resolve(cmd[1], e)
            else:
                self._resolve(cmd[1], None)

    def _resolve(self, waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future],
                 error: BaseException | None) -> None:
        """Wakes a caller of an engine-thread operation (done, or failed with `error`)."""
        with self._lock:
            if waiter not in self._waiters:
                return
            self._waiters.discard(waiter)
        loop, fut = waiter

        def wake() -> None:
            if fut.done():   # the caller was cancelled
                return
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)
        try:
            loop.call_soon_threadsafe(wake)
        except RuntimeError:   # the caller's loop is closed
            pass

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:   # whatever stops the loop must not leave a zombie
            self._die(e)
        else:   # stopped: operations still queued will never run
            self._fail_waiters()

    def _loop(self) -> None:
        core = self.core
        while True:
            # Block while idle; otherwise take whatever arrived since the last step.
            idle = not core.has_unfinished_requests()
            try:
                cmd = self._commands.get() if idle else self._commands.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd[0] == "stop":
                    self._abort_all()
                    return
                self._handle(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if not core.has_unfinished_requests():
                self._publish_stats()
                continue
            for out in core.step():   # failed requests come back as outputs with `error`
                if out.error is not None:
                    self._deliver(out.request_id, RequestFailedError(out.request_id, out.error))
                else:
                    self._deliver(out.request_id, out)
            self._publish_stats()

    def _die(self, error: BaseException) -> None:
        """Fatal: fail every caller, then tell the owner (once)."""
        logger.critical("the engine thread stopped: every request in flight fails and no "
                        "new one will run", exc_info=error)
        self._error = error   # before _fail_all: generate() sees it under the same lock
        self._fail_all()
        callback, self._on_fatal = self._on_fatal, None
        if callback is not None:
            try:
                callback(error)
            except Exception:   # noqa: BLE001 -- the thread is ending anyway
                logger.exception("on_fatal raised")

    def _dead_error(self) -> EngineDeadError:
        if self._error is None:
            return EngineDeadError("the engine is not running (it was shut down)")
        e = EngineDeadError(f"the engine stopped: {type(self._error).__name__}: {self._error}")
        e.__cause__ = self._error
        return e

    def _publish_stats(self) -> None:
        self.stats = EngineStats.of(self.core.stats(), self.core.num_compilations)

    def _abort_all(self) -> None:
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            out = self.core.abort_request(rid)
            self._deliver(rid, out if out is not None else EngineDeadError("engine stopped"))
        self._publish_stats()

    def _fail_waiters(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for waiter in waiters:
            self._resolve(waiter, self._dead_error())

    def _fail_all(self) -> None:
        self._fail_waiters()
        with self._lock:
            entries = list(self._streams.items())
            self._streams.clear()
        for _, (loop, stream) in entries:
            try:
                loop.call_soon_threadsafe(stream.put_nowait, self._dead_error())
            except RuntimeError:
                pass
