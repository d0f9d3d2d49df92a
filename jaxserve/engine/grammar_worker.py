"""The grammar compiler's own threads: a stack big enough for every grammar the limits
admit, jobs that never start once cancelled, and Python sections that stop when cancelled.

Why threads with a big stack, not a worker process: llguidance's compiler recurses once
per level of a rule or `$ref` chain (a few KiB of native stack each), and a thread's
stack overflowing kills the whole process. The size limits (grammar.py) bound that
recursion and these threads' stack holds it with room to spare, so no admitted grammar
can overflow. A process would also survive bugs nobody has measured, but a compiled
matcher cannot cross a process boundary (it would compile twice), each worker would
hold its own copy of the tokenizer, and fork after JAX started is unsafe.

Not the asyncio default pool: a slow compile must never hold up a request that needs no
grammar. Native code (llguidance's Rust) cannot be stopped once it runs; its time is
bounded by llguidance's fuel limits instead, and a cancelled job's result is dropped.
"""
from __future__ import annotations

import ctypes
import queue
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

# threading.stack_size is process-wide: set it only around starting these threads.
_STACK_LOCK = threading.Lock()
_local = threading.local()
_RESEND_S = 0.05


class Cancelled(BaseException):
    """Raised inside a job's interruptible section when the job is cancelled (a
    BaseException: the code it stops must not take it for one of its own errors)."""


class Job:
    """One compile: its future, and what cancel() needs to stop it."""

    def __init__(self, fn: Callable[..., Any], args: tuple):
        self.future: Future = Future()
        self.fn, self.args = fn, args
        self.started_at: float | None = None    # time.monotonic() when a thread took it
        self._thread_id: int | None = None
        self._cancelled = False                   # cancel() was called
        self._interruptible = False               # in a Python section cancel() may stop
        self._interrupted = False                 # Cancelled was sent to its thread

    def running_for(self) -> float:
        return 0.0 if self.started_at is None else time.monotonic() - self.started_at


class CompileWorkers:
    """num_threads daemon threads of stack_bytes each, fed from one queue."""

    def __init__(self, num_threads: int, stack_bytes: int, name: str = "grammar-compile"):
        _drop_interrupts_that_landed_elsewhere()
        self._queue: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopping: set[Job] = set()        # cancelled, still in an interruptible section
        self._stop_wanted = threading.Condition(self._lock)
        threading.Thread(target=self._resend, name=f"{name}-stop", daemon=True).start()
        with _STACK_LOCK:
            previous = threading.stack_size(stack_bytes)
            try:
                for i in range(num_threads):
                    threading.Thread(target=self._loop, name=f"{name}-{i}",
                                     daemon=True).start()
            finally:
                threading.stack_size(previous)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Job:
        job = Job(fn, args)
        self._queue.put(job)
        return job

    def cancel(self, job: Job) -> None:
        """A queued job never starts; a running one stops at its next Python bytecode
        inside an interruptible section (a native call first returns); elsewhere it runs
        on and its result is dropped. Its future is cancelled (or keeps its result)."""
        if job.future.cancel():      # still queued: the thread that takes it skips it
            return
        with self._lock:
            job._cancelled = True     # its next interruptible section will not start
            if job._interruptible and not job._interrupted:
                job._interrupted = True
                _raise_in(job._thread_id, Cancelled)
                self._stopping.add(job)
                self._stop_wanted.notify()

    def _resend(self) -> None:
        """Sends Cancelled again while a cancelled job is still in its section: one that
        lands in a weakref callback or __del__ (the collector runs them in whatever
        thread allocates) is dropped there, not raised in the job."""
        with self._lock:
            while True:
                self._stop_wanted.wait_for(lambda: self._stopping)
                self._stop_wanted.wait(_RESEND_S)
                for job in list(self._stopping):
                    if job._interruptible:
                        _raise_in(job._thread_id, Cancelled)
                    else:
                        self._stopping.discard(job)

    def interruptible(self) -> _Interruptible:
        """`with workers.interruptible():` marks pure-Python work of the calling thread's
        job that cancel() may stop: Cancelled is raised there. Outside a job: no effect."""
        return _Interruptible(self._lock)

    def _loop(self) -> None:
        job: Job | None = None
        while True:
            try:
                if job is not None:
                    self._done_with(job)
                    job = None
                job = self._queue.get()
                self._run(job)
            except Cancelled:
                # An interrupt raised outside the job's code (on its way out): the job
                # is over all the same; _done_with (next turn) takes back any other.
                continue

    def _run(self, job: Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return              # cancelled while queued: never started
        job._thread_id = threading.get_ident()
        job.started_at = time.monotonic()
        _local.job = job
        try:
            result = job.fn(*job.args)
        except BaseException as e:   # noqa: BLE001 - the waiter gets it (Rust panics too)
            _settle(job.future, error=e)
        else:
            _settle(job.future, result=result)

    def _done_with(self, job: Job) -> None:
        """After a job, whatever happened on its way out: no interrupt is sent for it
        any more and none is left pending for the next job."""
        with self._lock:
            job._interruptible = False
            self._stopping.discard(job)
            if job._interrupted:
                _raise_in(threading.get_ident(), None)
        _local.job = None
        job.fn = job.args = None      # what it held goes with it
        _settle(job.future, error=Cancelled())   # (a no-op if it has its outcome)


class _Interruptible:
    def __init__(self, lock: threading.Lock):
        self._lock = lock
        self._job: Job | None = getattr(_local, "job", None)

    def __enter__(self) -> None:
        job = self._job
        if job is None:
            return
        with self._lock:
            if job._cancelled:
                raise Cancelled()
            job._interruptible = True

    def __exit__(self, *exc: Any) -> None:
        job = self._job
        if job is None:
            return
        # Under the lock: no interrupt is sent after this, and one sent but not yet
        # raised is taken back (it must not reach whatever the thread runs next).
        with self._lock:
            job._interruptible = False
            if job._interrupted:
                _raise_in(job._thread_id, None)
        if job._interrupted and exc[0] is None:
            raise Cancelled()


def _settle(future: Future, *, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _drop_interrupts_that_landed_elsewhere() -> None:
    """Wraps sys.unraisablehook (once) so that a Cancelled that landed in a weakref
    callback or __del__ of a job's thread is dropped without a word: _resend sends it
    again. Any other unraisable exception goes to the hook that was there before (a
    test runner's, which would report the interrupt as an error of whatever test ran)."""
    previous = sys.unraisablehook
    if getattr(previous, "_drops_landed_interrupts", False):
        return

    def hook(unraisable: Any) -> None:
        if not (issubclass(unraisable.exc_type, Cancelled)
                and getattr(_local, "job", None) is not None):
            previous(unraisable)

    hook._drops_landed_interrupts = True   # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raises exc in the thread at its next bytecode (None: takes a pending one back)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None)
