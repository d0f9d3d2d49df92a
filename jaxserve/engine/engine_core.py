"""EngineCore: builds its parts (jaxserve/build/parts.py), then runs schedule -> execute ->
update, step by step."""
from __future__ import annotations

import atexit
import itertools
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.build.parts import EngineParts, build_parts, replica_shape, resolve_sources
from jaxserve.build.startup import STARTING, StartupProgress
from jaxserve.build.tokenizer import eos_token_ids, start_loading_tokenizer
from jaxserve.config import EngineConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from jaxserve.engine import multihost
from jaxserve.engine.async_scheduling import (SyncRequests, sync_reason_for_engine,
                                              sync_reason_for_request)
from jaxserve.engine.input_processor import EngineRequest, InputProcessor
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.protocol import EngineInfo
from jaxserve.errors import EngineDeadError, InputError
from jaxserve.multimodal.front import image_front
from jaxserve.runner import compile_counter
from models.config import ModelConfig

logger = logging.getLogger("jaxserve")


@dataclass
class _Step:
    """A step from begin_step: dispatched (in_flight), or failed already (error)."""
    sched_out: SchedulerOutput
    in_flight: Any = None
    error: Exception | None = None


class EngineCore:
    """One engine replica on a 1xM mesh (tensor parallel over M devices).

    mesh: this replica's mesh; None = make_mesh(config.mesh), which must then have
    D = 1 (D > 1 is jaxserve.engine.data_parallel.DataParallelEngine's job).
    seed_counter: where seeds for seedless requests come from (a data-parallel front
    door shares one, so every mesh gives a request the same seed).
    progress: told the phase of the construction (weights, KV cache, compiling program
    i of n), e.g. for the server's /health while it loads.
    """

    def __init__(self, config: EngineConfig, *, stream_outputs: bool = False,
                 mesh: Mesh | None = None,
                 seed_counter: Iterator[int] | None = None,
                 progress: StartupProgress | None = None):
        progress = progress or StartupProgress()
        progress.set_phase(STARTING, "reading the model's config and tokenizer")
        config = resolve_sources(config)
        self.model_config = mc = ModelConfig.from_pretrained(config.model)
        # Before the tokenizer's thread: two threads resolving transformers' lazy imports
        # at once can fail ("cannot import name 'AutoImageProcessor'").
        images = image_front(config)
        tokenizer = start_loading_tokenizer(config.tokenizer or config.model)
        shape = replica_shape(config, mc, mesh)
        self.mesh, self.config, self.layout = shape.mesh, shape.config, shape.layout
        for choice in self.layout.kernels:   # decided once, here: never a silent fallback
            (logger.warning if choice.fallback else logger.info)("%s", choice.describe())
        self.channel = self._open_channel()
        parts = build_parts(shape, progress, agree_num_pages=None if self.channel is None
                            else multihost.agree_on_min, images=images)
        self.model, self.params, self.runner = parts.model, parts.params, parts.runner
        self.prefix_caching = self.config.enable_prefix_caching
        self.tokenizer = tokenizer.result()
        # The runner reads them when it builds a step's inputs (stop tokens before min_tokens).
        self.runner.eos_token_ids = eos_ids = eos_token_ids(self.tokenizer, mc,
                                                            self.config.model)
        self.inputs = InputProcessor(tokenizer=self.tokenizer, vocab_size=mc.vocab_size,
                                     max_model_len=self.layout.max_model_len,
                                     eos_token_ids=eos_ids,
                                     max_logprobs=self.config.max_logprobs,
                                     images=images, lora=self.runner.lora)
        self.scheduler = Scheduler(parts.scheduler_config)
        self.outputs = OutputProcessor(self.tokenizer, stream=stream_outputs)
        self.num_steps = 0
        self.num_scheduled_tokens = 0   # tokens computed on device, all steps
        self._seed_counter = seed_counter or engine_seeds(self.config.seed)
        self.info = _engine_info(parts, eos_ids)
        self._init_async()

    def _init_async(self) -> None:
        """Async scheduling (engine/async_scheduling.py): on when asked for and nothing of
        the engine's needs each step's tokens first."""
        self.async_scheduling = self.config.async_scheduling
        self._in_flight: _Step | None = None   # dispatched, not yet collected
        self._collected: list[RequestOutput] = []   # its outputs, when collected early
        self._sync_requests = SyncRequests()
        self.num_overlapped_steps = 0   # steps dispatched while another was in flight
        if not self.async_scheduling:
            return
        why = sync_reason_for_engine(
            multi_host=self.channel is not None,
            speculative=self.config.speculative_config is not None,
            host_tier=self.runner.host_tier is not None,
            state_snapshots=self.scheduler.kv.snapshots is not None)
        if why is not None:
            self.async_scheduling = False
            logger.warning("async scheduling: off for %s; steps run in order", why)
        else:
            logger.info("async scheduling: on (step N+1 is dispatched before step N's "
                        "tokens are read back)")

    def _open_channel(self) -> multihost.StepChannel | None:
        """Several processes (multi-host): process 0 schedules and publishes each step."""
        if jax.process_count() == 1:
            return None
        multihost.check_mesh(self.mesh)
        channel = multihost.StepChannel()
        atexit.register(self.shutdown)   # followers must not wait for ever
        return channel

    # ---- requests ------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Adds a request from the input processor (self.inputs.process), which checked
        it: only an id already in use is refused here (InputError)."""
        request_id, params = request.request_id, request.sampling_params
        prompt_token_ids = list(request.prompt_token_ids)
        if self.outputs.has(request_id):
            raise InputError(f"request id {request_id!r} is already in use")
        # best_of > n: best_of samples run, the output processor returns the best n.
        num_samples = params.num_samples
        child_ids = [request_id] if num_samples == 1 else [f"{i}_{request_id}"
                                                           for i in range(num_samples)]
        # A completion id ("0_x") may equal another request's id: refuse it up front,
        # or undoing this add would touch the other request.
        taken = [c for c in child_ids if self.scheduler.get_request(c) is not None]
        if taken:
            raise InputError(f"request id {taken[0]!r} is already in use")
        self._collect_before_reuse(child_ids)
        added: list[str] = []
        arrival = request.arrival_time if request.arrival_time is not None else time.monotonic()
        try:
            self.outputs.add(request_id, request.prompt, prompt_token_ids, params, child_ids,
                             arrival_time=arrival)
            # A request-private scope keeps the prefix cache among the request's own n
            # completions: when caching is off, and when prompt logprobs are wanted (a
            # cached position would not be computed, so it would have no logprob).
            private = (params.prompt_logprobs is not None
                       or (not self.prefix_caching and num_samples > 1))
            scope = request_id if private else None
            for i, cid in enumerate(child_ids):
                child = params if num_samples == 1 else params.child(i)
                if child.seed is None:
                    child = replace(child, seed=next(self._seed_counter))
                self.scheduler.add_request(Request(
                    cid, prompt_token_ids, child, eos_token_id=self.info.eos_token_ids,
                    arrival_time=arrival, priority=request.priority,
                    cache_salt=request.cache_salt, cache_scope=scope,
                    page_size=self.config.page_size, lora_request=request.lora_request,
                    multi_modal=request.multi_modal))
                added.append(cid)
            if self.async_scheduling:
                self._sync_requests.add(child_ids, sync_reason_for_request(
                    params, request.multi_modal))
        except BaseException as e:
            # Whatever went wrong, leave no half-added request behind.
            try:
                self.scheduler.abort_requests(added)
                self.outputs.abort(request_id)
            except Exception as e2:
                raise EngineDeadError(f"undoing a failed add of {request_id!r} failed: "
                                      f"{type(e2).__name__}: {e2}") from e
            raise

    def abort_request(self, request_id: str) -> RequestOutput | None:
        children = self.outputs.child_ids(request_id)
        self.scheduler.abort_requests(children)
        return self.outputs.abort(request_id)

    # ---- the loop ------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return (self._in_flight is not None or bool(self._collected)
                or self.scheduler.has_unfinished_requests())

    def _collect_before_reuse(self, ids: list[str]) -> None:
        """An id of the step in flight given to a new request (the old one was aborted or
        finished meanwhile): that step is collected first, so that its token is never
        taken for the new request's; its outputs come with the next step's."""
        step = self._in_flight
        if step is not None and not set(ids).isdisjoint(step.sched_out.req_ids):
            self._in_flight = None
            self._collected += self.finish_step(step)

    def step(self) -> list[RequestOutput]:
        """One step's outputs. A step that raises fails only its own requests (outputs
        with `error`); EngineDeadError when the engine cannot go on. With async scheduling
        a step stays in flight between calls: each call dispatches the next step, then
        returns the outputs of the one before it."""
        if not self.async_scheduling:
            return self.finish_step(self.begin_step())
        prev, self._in_flight = self._in_flight, None
        outs, self._collected = self._collected, []
        if prev is not None and (self._must_sync() or
                                 not self.scheduler.has_unfinished_requests()):
            outs, prev = outs + self.finish_step(prev), None
        step = self.begin_step()
        if prev is not None:
            self.num_overlapped_steps += 1
            outs += self.finish_step(prev)
        if (step.error is None and step.sched_out.num_scheduled_tokens
                and not self._must_sync()):
            self._in_flight = step
        else:
            outs += self.finish_step(step)
        return outs

    def _must_sync(self) -> bool:
        """Whether an unfinished request needs each step's tokens before the next."""
        return self._sync_requests.any_unfinished(self.scheduler.requests)

    def begin_step(self) -> _Step:
        """Schedules and dispatches one step; the device works while the host goes on."""
        try:
            self._follow_kv_scales()
            sched_out = self.scheduler.schedule()
            # Followers keep the same persistent batch: every diff reaches them, even
            # one that only drops rows.
            if self.channel is not None and not sched_out.is_empty:
                self.channel.publish(sched_out)
        except Exception as e:
            # A half-done schedule leaves pages and queues in an unknown state.
            raise EngineDeadError(f"scheduling failed: {type(e).__name__}: {e}") from e
        self.num_steps += 1
        self.num_scheduled_tokens += sched_out.num_scheduled_tokens
        if sched_out.new_reqs:
            self.outputs.mark_scheduled([r.req_id for r in sched_out.new_reqs])
        try:
            return _Step(sched_out, self.runner.dispatch(sched_out))
        except Exception as e:   # reported by finish_step, so other replicas still collect
            return _Step(sched_out, error=e)

    def _follow_kv_scales(self) -> None:
        """Cached pages are stored under the KV scales of their time: when the runner's
        params bring others (a weight update), both tiers of the prefix cache are reset,
        so nothing stored under the old ones is restored or shared."""
        tier = self.runner.host_tier
        if tier is not None and tier.follow_scales():
            logger.warning("the KV scales changed: the prefix cache (device and host) is reset")
            self.scheduler.reset_prefix_cache()

    def finish_step(self, step: _Step) -> list[RequestOutput]:
        """Waits for a step from begin_step and applies its results."""
        sched_out = step.sched_out
        if step.error is not None:
            return self._fail_step(sched_out, step.error, [])
        outs: list[RequestOutput] = []
        try:
            runner_out = self.runner.collect(step.in_flight)
            updated = self.scheduler.update_from_output(sched_out, runner_out.sampled,
                                                        runner_out.spec_token_ids,
                                                        runner_out.failed)
            for rid, why in runner_out.failed.items():   # once per request: it ends here
                logger.warning("request %s: its structured output failed (%s); it ends "
                               "with finish_reason \"error\"", rid, why)
            outs, stopped = self.outputs.process(updated, runner_out)
            if stopped:
                self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
            return outs
        except Exception as e:
            return self._fail_step(sched_out, e, outs)

    def _fail_step(self, sched_out: SchedulerOutput, error: Exception,
                   done: list[RequestOutput]) -> list[RequestOutput]:
        """Aborts every request of the failed step (all n completions of each) and
        returns one finished output with `error` per request; `done`: outputs the step
        had already produced, kept for requests it finished before failing."""
        message = f"{type(error).__name__}: {error}"
        child_ids = sched_out.req_ids + sched_out.restoring_req_ids
        parents = self.outputs.parents_of(child_ids)
        logger.error("engine step %d failed (%s); failing requests %s", self.num_steps,
                     message, parents, exc_info=error)
        if self.channel is not None:   # the followers ran this step too: out of sync
            raise EngineDeadError(f"a multi-host step failed: {message}") from error
        if not self.runner.device_state_ok():
            raise EngineDeadError(f"the KV cache / recurrent state was lost when a step "
                                  f"failed: {message}") from error
        try:
            children = child_ids + [c for p in parents for c in self.outputs.child_ids(p)]
            self.scheduler.fail_step(sched_out, children)
            failed = []
            for rid in parents:
                out = self.outputs.abort(rid)
                out.error = message
                failed.append(out)
        except Exception as e:
            raise EngineDeadError(f"recovering from a failed step failed: "
                                  f"{type(e).__name__}: {e} (the step: {message})") from e
        gone = set(parents)
        return [o for o in done if o.request_id not in gone] + failed

    @property
    def num_compilations(self) -> int:
        return compile_counter.num_compilations()

    # ---- multi-host -------------------------------------------------------------------
    def follow(self) -> None:
        """Processes other than 0: run every step process 0 publishes, until it stops."""
        if self.channel is None or multihost.is_leader():
            raise ValueError("follow() is for processes other than 0 of a multi-host run")
        # New requests' grammars come as specs: compiled here as the front door does.
        compile_grammar = lambda so: self.inputs.grammar_compiler().compile(so)  # noqa: E731
        while (sched_out := self.channel.receive(compile_grammar)) is not None:
            self.runner.execute(sched_out)

    def shutdown(self) -> None:
        """Process 0 of a multi-host run: release the followers; the host tier's timer
        thread stops."""
        if self.channel is not None and multihost.is_leader():
            self.channel.close()
        if self.runner.host_tier is not None:
            self.runner.host_tier.timer.close()

    # ---- load, for the data-parallel front door and the metrics ------------------------
    def num_unfinished(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def cached_prefix_pages(self, page_hashes: list[int]) -> int:
        """How many leading pages (by chained hash, prompt_page_hashes) this replica's
        prefix cache holds, on device and then in its host tier; a read-only look-up that
        counts no cache statistics."""
        if not self.prefix_caching:
            return 0
        kv = self.scheduler.kv
        cached = kv.pool.cached_pages
        n = next((i for i, h in enumerate(page_hashes) if h not in cached), len(page_hashes))
        if kv.host is not None:
            n += next((i for i, h in enumerate(page_hashes[n:]) if h not in kv.host.index),
                      len(page_hashes) - n)
        return n

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        if stats.host is not None:   # the runner times the restores it dispatches
            tier = self.runner.host_tier
            buckets, total = tier.timer.counts()
            stats = replace(stats, host=replace(
                stats.host, restore_seconds=tier.restore_seconds,
                restore_time_buckets=buckets, restore_time_sum=total))
        return stats

    def remove_lora(self, lora_int_id: int) -> None:
        """Unloads an adapter from the device slots and the host cache; ValueError while
        a request uses it."""
        self.scheduler.remove_lora(lora_int_id)
        if self.runner.lora is not None:
            self.runner.lora.forget(lora_int_id)

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()


def prompt_page_hashes(prompt_token_ids: list[int], page_size: int,
                        cache_salt: str | None = None, lora_request: Any = None,
                        multi_modal: Any = None) -> list[int]:
    """The chained hashes of the prompt's full pages, as a request with this cache salt,
    adapter and images (and no private scope) has them: a page holding image tokens
    mixes in its images' content hashes, so two different images behind the same
    placeholder ids never look like a shared prefix."""
    return Request("probe", prompt_token_ids, None, cache_salt=cache_salt,
                   page_size=page_size, lora_request=lora_request,
                   multi_modal=multi_modal).page_hashes


def engine_seeds(seed: int) -> Iterator[int]:
    """Seeds for requests that bring none: reproducible from the engine seed."""
    return itertools.count(seed * 1_000_003 + 1)


def _engine_info(parts: EngineParts, eos_ids: tuple[int, ...]) -> EngineInfo:
    """The engine's facts, from their one owner each (layout, loaded model, plan)."""
    config, layout, runner = parts.shape.config, parts.shape.layout, parts.runner
    return EngineInfo(
        config=config, model_config=parts.shape.model_config,
        dtype=jnp.dtype(layout.dtype).name, max_model_len=layout.max_model_len,
        cache_plan=parts.plan, weight_bytes=parts.weight_bytes,
        weight_bytes_per_device=parts.weight_bytes_per_device,
        eos_token_id=eos_ids[0] if eos_ids else None, eos_token_ids=eos_ids,
        warmup_seconds=runner.warmup_seconds, warmup_compilations=runner.warmup_compilations,
        warmup_cache_hits=runner.warmup_cache_hits,
        warmup_fresh_compilations=runner.warmup_fresh_compilations)
