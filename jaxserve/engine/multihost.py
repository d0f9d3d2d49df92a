"""Multi-host serving: one process per host under jax.distributed; process 0 leads.

JAX is multi-controller: every process must run the same jitted computations
on the same inputs, each feeding its own devices. Process 0 owns the scheduler
and (in the server) the HTTP front end. Before each step's device work it
publishes the step's SchedulerOutput (a diff: every process's runner keeps the
same persistent batch) through the coordination service that
jax.distributed already runs (its key-value store: JAX's own runtime, no
extra RPC layer); every other process reads it and runs the identical
`ModelRunner.execute`, so the host arrays, the jitted calls and their order
agree everywhere. Results are replicated, so process 0 reads its own copy.

A step carries only plain data (_StepPickler): a structured-output grammar, compiled by
the leader's front door into native llguidance objects, goes as its spec and each
follower compiles its own (the same tokenizer and library, so the same masks); bad
words go as their token ids and each follower rebuilds the automaton
(engine/bad_words.py); SamplingParams.extra_args, which no runner reads and which may
hold anything offline, is left out.

Scope: one replica (D = 1) whose model axis spans every device of every
process, e.g. "1x16" on two 8-GPU hosts. Data parallelism across hosts would
need the replicas' results sent back to process 0; run one server per host
behind a load balancer instead.
"""
from __future__ import annotations

import io
import logging
import os
import pickle
from dataclasses import replace
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.core.sched_output import SchedulerOutput
from jaxserve.engine.grammar import CompiledGrammar
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("jaxserve")

ENV_ADDRESS = "JAXSERVE_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXSERVE_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXSERVE_PROCESS_ID"
_PREFIX = "jaxserve/step"
_POLL_MS = 60_000


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """jax.distributed.initialize from the arguments, else the JAXSERVE_* environment.
    Returns whether this is a multi-process run. Call before anything uses jax devices."""
    address = coordinator_address or os.environ.get(ENV_ADDRESS)
    if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
        num_processes = int(os.environ[ENV_NUM_PROCESSES])
    if process_id is None and os.environ.get(ENV_PROCESS_ID):
        process_id = int(os.environ[ENV_PROCESS_ID])
    if address is None and num_processes is None and process_id is None:
        return False
    if address is None or num_processes is None or process_id is None:
        raise ValueError(f"multi-host needs all three of coordinator address ({address!r}), "
                         f"number of processes ({num_processes!r}) and process id "
                         f"({process_id!r}); flags --coordinator-address / --num-processes / "
                         f"--process-id or env {ENV_ADDRESS} / {ENV_NUM_PROCESSES} / "
                         f"{ENV_PROCESS_ID}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} must be in [0, {num_processes})")
    from jax._src.distributed import global_state   # (jax's private state: read late)
    if global_state.client is None:
        jax.distributed.initialize(coordinator_address=address, num_processes=num_processes,
                                   process_id=process_id)
    logger.info("jax.distributed: process %d of %d, %d local / %d global devices",
                jax.process_index(), jax.process_count(), jax.local_device_count(),
                jax.device_count())
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def check_mesh(mesh: Mesh) -> None:
    """A multi-process mesh must be one replica over every device (see the module doc)."""
    if mesh.devices.size != jax.device_count() or mesh.devices.shape[0] != 1:
        raise ValueError(f"with {jax.process_count()} processes the mesh must be 1x"
                         f"{jax.device_count()} (one replica over all devices), got "
                         f"{mesh.devices.shape[0]}x{mesh.devices.shape[1]}; data parallelism "
                         f"across hosts is not supported: run one server per host")


def agree_on_min(value: int) -> int:
    """The smallest of every process's value (e.g. a KV page count sized from free memory)."""
    from jax.experimental import multihost_utils   # (only multi-host runs need it)
    return int(np.min(multihost_utils.process_allgather(np.array([value], np.int64))))


class StepChannel:
    """Process 0 -> every other process: the scheduler output of each step, in order.

    Each follower gets its own key per step and deletes it once read, so the
    coordinator holds at most the steps not yet read.
    """

    def __init__(self):
        from jax._src.distributed import global_state   # (see initialize)
        self._client = global_state.client
        self._step = 0
        self._closed = False

    def publish(self, sched_out: SchedulerOutput) -> None:
        # A diff: new requests whole (once), running ones as new pages and counts.
        self._send(dumps(sched_out))

    def close(self) -> None:
        """Tells the followers to stop (idempotent)."""
        if not self._closed:
            self._closed = True
            self._send(b"")

    def _send(self, payload: bytes) -> None:
        for pid in range(1, jax.process_count()):
            self._client.key_value_set_bytes(f"{_PREFIX}/{pid}/{self._step}", payload)
        self._step += 1

    def receive(self, compile_grammar: Callable[[StructuredOutputsParams], Any]
                ) -> SchedulerOutput | None:
        """The next step's scheduler output, or None when the leader has stopped.
        compile_grammar: this process's compiler (GrammarCompiler.compile) for the
        grammars of new requests."""
        key = f"{_PREFIX}/{jax.process_index()}/{self._step}"
        while True:
            try:
                payload = self._client.blocking_key_value_get_bytes(key, _POLL_MS)
                break
            except jax.errors.JaxRuntimeError as e:   # a timeout: keep waiting for work
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self._client.key_value_delete(key)
        self._step += 1
        return loads(payload, compile_grammar) if payload else None


def dumps(step: Any) -> bytes:
    """A step as plain data (the module doc says what is left out or sent as a spec)."""
    buf = io.BytesIO()
    _StepPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(step)
    return buf.getvalue()


def loads(payload: bytes, compile_grammar: Callable[[StructuredOutputsParams], Any]) -> Any:
    """A step from dumps, its grammars compiled by compile_grammar."""
    return _StepUnpickler(io.BytesIO(payload), compile_grammar).load()


def _grammar(spec: StructuredOutputsParams) -> Any:
    """Where a step names a grammar: _StepUnpickler compiles it (never called itself)."""
    raise RuntimeError("a step's grammar is compiled by the unpickler's compiler")


def _same(obj: Any) -> Any:
    return obj


class _StepPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        # (not called for ints, lists, dicts and the like: token ids pickle at C speed)
        if isinstance(obj, CompiledGrammar):
            return _grammar, (obj.spec,)
        if isinstance(obj, SamplingParams) and obj.extra_args is not None:
            return _same, (replace(obj, extra_args=None),)
        return NotImplemented


class _StepUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, compile_grammar: Callable):
        super().__init__(file)
        self._compile_grammar = compile_grammar

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == _grammar.__name__:
            return self._compile_grammar
        return super().find_class(module, name)
