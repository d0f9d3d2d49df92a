"""Data parallelism: D engine replicas behind one front door.

`make_engine(config)` is what LLM and AsyncEngine build: a plain EngineCore
for a "1xM" mesh, a DataParallelEngine for "DxM" with D > 1. Both are an
Engine (jaxserve.engine.protocol), so callers do not know which they hold.

Each replica is a whole EngineCore (scheduler, KV pages, runner) on its own
1xM sub-mesh, devices d*M .. (d+1)*M - 1. A step dispatches every busy
replica's device work first and only then waits for the results, so on an
accelerator the replicas run at the same time (jit dispatch is asynchronous);
on CPU they simply take turns.

Routing (at add time, a request never moves): the replica with the longest
cached prompt prefix among those within `balance_slack` unfinished requests of
the least loaded one; ties go to the least loaded, then the lowest index. The
slack bounds how much imbalance a prefix hit may buy. The prefix is hashed as the
replicas' prefix caches hash it, images' content included: a prompt holding an image
is drawn to the replica that holds that image's pages, never to one that holds only
another image behind the same placeholder ids.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Iterator, Sequence

from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.scheduler import SchedulerStats
from jaxserve.engine import multihost
from jaxserve.engine.engine_core import EngineCore, engine_seeds, prompt_page_hashes
from jaxserve.errors import InputError
from jaxserve.engine.input_processor import EngineRequest
from jaxserve.engine.protocol import Engine, EngineInfo
from jaxserve.build.device_pool import set_device_pool
from jaxserve.build.gpu_xla_flags import quantized_weights, set_gpu_xla_flags
from jaxserve.build.startup import READY, StartupProgress
from sharding import DATA, make_mesh, replica_meshes

logger = logging.getLogger("jaxserve")


def make_engine(config: EngineConfig, *, stream_outputs: bool = False,
                progress: StartupProgress | None = None) -> Engine:
    """progress: follows the construction; READY once the engine is built."""
    # Before anything makes JAX's backends: its GPU pool is the engine's share.
    logger.info("%s", set_device_pool(config.hbm_utilization))
    gpu_flags = set_gpu_xla_flags(quantized_weights(config.quantization, config.model))
    if gpu_flags:
        logger.info("%s", gpu_flags)
    multihost.initialize()   # from JAXSERVE_* env, when set (the CLI passes its flags first)
    mesh = make_mesh(config.mesh)
    if mesh.shape[DATA] == 1:
        engine = EngineCore(config, stream_outputs=stream_outputs, mesh=mesh, progress=progress)
    else:
        engine = DataParallelEngine(config, stream_outputs=stream_outputs, mesh=mesh,
                                    progress=progress)
    if progress is not None:
        progress.set_phase(READY)
    return engine


class DataParallelEngine:
    def __init__(self, config: EngineConfig, *, stream_outputs: bool = False,
                 mesh: Mesh | None = None,
                 balance_slack: int = 2, progress: StartupProgress | None = None):
        mesh = mesh if mesh is not None else make_mesh(config.mesh)
        self.balance_slack = balance_slack
        # One seed sequence for all replicas: a seedless request gets the same seed
        # whatever the mesh, as in a single engine.
        seeds: Iterator[int] = engine_seeds(config.seed)
        if config.async_scheduling:   # (replicas are dispatched in turn, then collected)
            logger.warning("async scheduling: off with data parallelism; steps run in order")
            config = replace(config, async_scheduling=False)
        self.replicas = [EngineCore(config, stream_outputs=stream_outputs, mesh=sub,
                                    seed_counter=seeds, progress=progress)
                         for sub in replica_meshes(mesh)]
        first = self.replicas[0]
        self.tokenizer = first.tokenizer
        # One front door: replica 0's processor has the limits every replica shares.
        self.inputs = first.inputs
        self.info = combined_info(self.replicas)
        self._replica_of: dict[str, int] = {}
        logger.info("data parallel: %d replicas of mesh 1x%d", len(self.replicas),
                    mesh.shape["model"])

    # ---- requests ------------------------------------------------------------------
    def choose_replica(self, prompt_token_ids: Sequence[int],
                       cache_salt: str | None = None, lora_request: Any = None,
                       multi_modal: Any = None) -> int:
        loads = [r.num_unfinished() for r in self.replicas]
        ok = [i for i, n in enumerate(loads) if n <= min(loads) + self.balance_slack]
        if len(ok) == 1:
            return ok[0]
        hashes = prompt_page_hashes(prompt_token_ids, self.info.page_size, cache_salt,
                                    lora_request, multi_modal)
        return max(ok, key=lambda i: (self.replicas[i].cached_prefix_pages(hashes),
                                      -loads[i], -i))

    def add_request(self, request: EngineRequest) -> None:
        """A request from self.inputs.process, checked there: only an id already in use
        is refused here (InputError)."""
        rid = request.request_id
        if rid in self._replica_of:
            raise InputError(f"request id {rid!r} is already in use")
        d = self.choose_replica(request.prompt_token_ids, request.cache_salt,
                                request.lora_request, request.multi_modal)
        self.replicas[d].add_request(request)
        self._replica_of[rid] = d

    def abort_request(self, request_id: str) -> RequestOutput | None:
        d = self._replica_of.pop(request_id, None)
        return None if d is None else self.replicas[d].abort_request(request_id)

    # ---- the loop ------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        return self.finish_step(self.begin_step())

    def begin_step(self) -> list[tuple[EngineCore, object]]:
        """Every busy replica dispatches its step; none is waited for yet."""
        return [(r, r.begin_step()) for r in self.replicas if r.has_unfinished_requests()]

    def finish_step(self, begun: list[tuple[EngineCore, object]]) -> list[RequestOutput]:
        """Waits for each replica's step from begin_step, in turn."""
        outs: list[RequestOutput] = []
        for r, step in begun:
            outs.extend(r.finish_step(step))
        for o in outs:
            if o.finished:
                self._replica_of.pop(o.request_id, None)
        return outs

    # ---- load and statistics ----------------------------------------------------------
    def num_unfinished(self) -> int:
        return sum(r.num_unfinished() for r in self.replicas)

    def stats(self) -> SchedulerStats:
        return SchedulerStats.merge([r.stats() for r in self.replicas])

    def remove_lora(self, lora_int_id: int) -> None:
        """Unloads an adapter from every replica; ValueError while a request uses it
        (checked on all first, so none is half unloaded)."""
        for r in self.replicas:
            if any(q.lora_id == lora_int_id for q in r.scheduler.requests.values()):
                r.remove_lora(lora_int_id)   # raises, naming the adapter
        for r in self.replicas:
            r.remove_lora(lora_int_id)

    def reset_prefix_cache(self) -> None:
        for r in self.replicas:
            r.reset_prefix_cache()

    def shutdown(self) -> None:
        for r in self.replicas:
            r.shutdown()

    @property
    def num_compilations(self) -> int:
        return self.replicas[0].num_compilations      # the counter is per process


def combined_info(replicas: Sequence[EngineCore]) -> EngineInfo:
    """Replica 0's facts (num_pages and the weight bytes stay per replica: every
    replica has the same), with the warmup figures summed over the replicas."""
    first = replicas[0].info
    infos = [r.info for r in replicas]
    return replace(first, num_replicas=len(replicas),
                   warmup_seconds=sum(i.warmup_seconds for i in infos),
                   warmup_compilations=sum(i.warmup_compilations for i in infos),
                   warmup_cache_hits=sum(i.warmup_cache_hits for i in infos),
                   warmup_fresh_compilations=sum(i.warmup_fresh_compilations for i in infos))
