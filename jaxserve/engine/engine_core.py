"""EngineCore: loads the model, then runs schedule -> execute -> update, step by step."""
from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Iterator

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from jaxserve.engine import multihost
from jaxserve.build.drafter_loader import load_drafter
from jaxserve.errors import EngineDeadError, InputError
from jaxserve.engine.input_processor import EngineRequest, InputProcessor
from jaxserve.build.layout import engine_layout, layout_cache_plan, make_runner
from jaxserve.build.loader import load_model
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.protocol import EngineInfo
from jaxserve.engine.startup import (ALLOCATING_KV_CACHE, COMPILING, LOADING_WEIGHTS,
                                     STARTING, StartupProgress)
from jaxserve.checkpoints.converted import resolve_converted
from jaxserve.checkpoints.model_names import resolve_model, resolve_tokenizer
from jaxserve.runner import compile_counter
from jaxserve.speculative import MTP
from models.config import ModelConfig
from sharding import DATA, make_mesh

logger = logging.getLogger("jaxserve")


def enable_compilation_cache(path: str | None) -> None:
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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

    def __init__(self, config: EngineConfig, *, stream_outputs: bool = False, mesh=None,
                 seed_counter: Iterator[int] | None = None,
                 progress: StartupProgress | None = None):
        progress = progress or StartupProgress()
        progress.set_phase(STARTING, "reading the model's config and tokenizer")
        # An alias or HF repo id becomes a local directory (downloaded when missing)
        # before anything reads it; so does a --tokenizer that names one.
        config = replace(
            config, model=resolve_model(config.model, load_format=config.load_format,
                                        revision=config.revision,
                                        download_dir=config.download_dir),
            tokenizer=config.tokenizer and resolve_tokenizer(config.tokenizer,
                                                             download_dir=config.download_dir))
        # A converted checkpoint (python -m jaxserve.convert) brings its dtype (and
        # quantization); settings it cannot serve are refused here, before any work.
        config = resolve_converted(config)
        enable_compilation_cache(config.compilation_cache_dir)
        if config.load_format != "dummy" and not os.path.isdir(config.model):
            raise ValueError(f"model path {config.model!r} does not exist or is not a directory")
        self.model_config = mc = ModelConfig.from_pretrained(config.model)
        # Importing transformers takes ~2 s of a 2-core CPU start: it overlaps the mesh,
        # the model, its weights and the compilation, and is awaited once they are done.
        tokenizer = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        tokenizer_loaded = tokenizer.submit(_load_tokenizer, config.tokenizer or config.model)
        tokenizer.shutdown(wait=False)
        self.mesh = mesh if mesh is not None else make_mesh(config.mesh)
        if self.mesh.shape[DATA] != 1:
            raise ValueError(f"EngineCore runs one replica (a 1xM mesh), got mesh "
                             f"{dict(self.mesh.shape)}; jaxserve.engine.data_parallel."
                             f"make_engine builds D replicas")
        self.config = config = config.for_platform(self.mesh.devices.flat[0].platform)
        self.layout = layout = engine_layout(config, mc, self.mesh)
        # Several processes (multi-host): process 0 schedules and publishes each step.
        self.channel = None
        if jax.process_count() > 1:
            multihost.check_mesh(self.mesh)
            self.channel = multihost.StepChannel()
            atexit.register(self.shutdown)   # followers must not wait for ever

        progress.set_phase(LOADING_WEIGHTS, f"loading the weights of {config.model}")
        loaded = load_model(config, layout, self.mesh,
                            on_progress=partial(_report_loading, progress))
        self.model, self.params = loaded.model, loaded.params
        drafter = load_drafter(config, layout, self.mesh)

        self.prefix_caching = config.enable_prefix_caching
        if mc.is_hybrid:
            logger.info("hybrid model: %d of %d layers are linear attention with recurrent "
                        "state, the other %d keep KV pages; prefix caching %s",
                        len(mc.linear_attention_layers), mc.num_layers,
                        len(mc.full_attention_layers),
                        "keeps state snapshots at page boundaries"
                        if self.prefix_caching else "is off")
        progress.set_phase(ALLOCATING_KV_CACHE, "sizing and allocating the KV cache")
        # Sized per device: each device holds kv_heads / M heads of every page.
        plan = layout_cache_plan(config, layout, self.mesh.devices.flat[0],
                                 drafter_specs=drafter.cache_specs if drafter else ())
        if self.channel is not None:   # every process must build the same cache shape
            plan = plan.with_num_pages(multihost.agree_on_min(plan.num_pages))
        logger.info("%s", plan.describe())
        if config.speculative_config is not None:
            logger.info("%s", config.speculative_config.describe())

        self.runner = make_runner(
            config, layout, plan, model=self.model, params=self.params, mesh=self.mesh,
            drafter=drafter and drafter.build(plan, config, layout, target_model=self.model,
                                              mesh=self.mesh))
        if config.enforce_eager:   # each program compiles when a step first needs it
            logger.info("enforce_eager: no warmup; programs compile on first use")
        else:
            progress.set_phase(COMPILING, "listing the programs to compile")
            self.runner.warmup(partial(_report_compiling, progress))
        self.tokenizer = tokenizer_loaded.result()
        # The runner reads it when it builds a step's inputs (stop tokens before min_tokens).
        eos_ids = _eos_token_ids(self.tokenizer, mc, config.model)
        self.inputs = InputProcessor(tokenizer=self.tokenizer, vocab_size=mc.vocab_size,
                                     max_model_len=layout.max_model_len, eos_token_ids=eos_ids,
                                     max_logprobs=config.max_logprobs)
        self.runner.eos_token_ids = eos_ids
        eos = eos_ids[0] if eos_ids else None
        self.scheduler = Scheduler(
            num_pages=plan.num_pages, page_size=plan.page_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.num_batched_tokens,
            max_model_len=layout.max_model_len, enable_prefix_caching=self.prefix_caching,
            policy=config.scheduling_policy, num_state_slots=plan.num_state_slots,
            num_snapshot_slots=plan.num_snapshot_slots,
            num_sliding_pages=plan.num_sliding_pages, sliding_window=plan.sliding_window,
            num_speculative_tokens=config.speculative_config.num_speculative_tokens
            if config.speculative_config else 0,
            num_lookahead_tokens=config.speculative_config.num_lookahead_tokens
            if config.speculative_config else 0,
            drop_last_hit_page=config.speculative_config is not None
            and config.speculative_config.method == MTP)
        self.outputs = OutputProcessor(self.tokenizer, stream=stream_outputs)
        self.num_steps = 0
        self.num_scheduled_tokens = 0   # tokens computed on device, all steps
        self._seed_counter = seed_counter or engine_seeds(config.seed)
        # The engine's facts have one owner from here on (layout, loaded model, plan).
        runner = self.runner
        self.info = EngineInfo(
            config=config, model_config=mc, dtype=jnp.dtype(layout.dtype).name,
            max_model_len=layout.max_model_len, cache_plan=plan,
            weight_bytes=loaded.weight_bytes,
            weight_bytes_per_device=loaded.weight_bytes_per_device, eos_token_id=eos,
            eos_token_ids=eos_ids,
            warmup_seconds=runner.warmup_seconds,
            warmup_compilations=runner.warmup_compilations,
            warmup_cache_hits=runner.warmup_cache_hits,
            warmup_fresh_compilations=runner.warmup_fresh_compilations)

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
                    page_size=self.config.page_size))
                added.append(cid)
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
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One step's outputs. A step that raises fails only its own requests (outputs
        with `error`); EngineDeadError when the engine cannot go on."""
        return self.finish_step(self.begin_step())

    def begin_step(self) -> _Step:
        """Schedules and dispatches one step; the device works while the host goes on."""
        try:
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
        child_ids = sched_out.req_ids
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
        """Process 0 of a multi-host run: release the followers (no-op otherwise)."""
        if self.channel is not None and multihost.is_leader():
            self.channel.close()

    # ---- load, for the data-parallel front door and the metrics ------------------------
    def num_unfinished(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def cached_prefix_pages(self, block_hashes: list[int]) -> int:
        """How many leading pages (by chained hash, prompt_block_hashes) this replica's
        prefix cache holds; a read-only look-up that counts no cache statistics."""
        if not self.prefix_caching:
            return 0
        cached = self.scheduler.kv.pool.cached_blocks
        return next((i for i, h in enumerate(block_hashes) if h not in cached),
                    len(block_hashes))

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()


def _report_loading(progress: StartupProgress, done: int, total: int) -> None:
    progress.advance(done, total, f"loaded {done / 2**30:.2f} of {total / 2**30:.2f} GiB "
                                  "of weights")


def _report_compiling(progress: StartupProgress, done: int, total: int) -> None:
    detail = (f"compiling program {done + 1} of {total}" if done < total
              else f"compiled {total} programs, running each once")
    progress.advance(done, total, detail)


def prompt_block_hashes(prompt_token_ids: list[int], page_size: int,
                        cache_salt: str | None = None) -> list[int]:
    """The chained hashes of the prompt's full pages, as a request with this cache salt
    (and no private scope) has them."""
    return Request("probe", prompt_token_ids, None, cache_salt=cache_salt,
                   page_size=page_size).block_hashes


def engine_seeds(seed: int) -> Iterator[int]:
    """Seeds for requests that bring none: reproducible from the engine seed."""
    return itertools.count(seed * 1_000_003 + 1)


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        logger.warning("no tokenizer at %s (%s): prompts must be token ids and outputs "
                       "carry no text", path, e)
        return None


def _eos_token_ids(tokenizer, mc: ModelConfig, model_dir: str) -> tuple[int, ...]:
    """Every id that ends a sequence (as vLLM): the tokenizer's eos first, then the
    config's and generation_config.json's (Gemma 4: <eos> and <turn|>; Llama 3.1:
    <|eot_id|> and <|eom_id|>)."""
    ids = [tokenizer.eos_token_id] if tokenizer is not None and \
        tokenizer.eos_token_id is not None else []
    ids += mc.eos_token_ids
    gen = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen):
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else list(eos or ())
    return tuple(dict.fromkeys(int(i) for i in ids))
