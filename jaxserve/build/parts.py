"""An engine replica's parts, built from its EngineConfig: where the model comes from,
the mesh and layout, the weights, the model drafter, the cache plan, the runner (its
programs compiled) and the scheduler's settings. EngineCore builds through here, then
runs its loop; `python -m jaxserve.plan --compile` builds the same parts abstractly
(planning/plan_compile.py)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.build.cache_plan import CachePlan
from jaxserve.build.drafter_loader import DrafterParts, load_drafter
from jaxserve.build.host_tier import (attach_host_tier, check_host_tier, describe,
                                      describe_cost, host_tier_slice, restore_cost)
from jaxserve.build.layout import EngineLayout, engine_layout, layout_cache_plan
from jaxserve.build.loader import load_model
from jaxserve.build.slices import runner_config, scheduler_config
from jaxserve.build.vision import load_vision
from jaxserve.build.startup import (ALLOCATING_KV_CACHE, COMPILING, LOADING_WEIGHTS,
                                    StartupProgress)
from jaxserve.checkpoints.converted import resolve_converted
from jaxserve.checkpoints.model_names import resolve_model, resolve_tokenizer
from jaxserve.config import EngineConfig
from jaxserve.core.scheduler_config import SchedulerConfig
from jaxserve.multimodal.front import ImageFront
from jaxserve.runner.image_encoder import VisionParts
from jaxserve.runner.lora_store import LoRAConfig, LoRAStore
from jaxserve.runner.model_runner import ModelRunner
from models.config import ModelConfig
from sharding import DATA, kv_head_repeats, make_mesh

logger = logging.getLogger("jaxserve")


def enable_compilation_cache(path: str | None) -> None:
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def resolve_sources(config: EngineConfig) -> EngineConfig:
    """The config with local directories for its model and tokenizer (an alias or HF repo
    id is downloaded when missing) and a converted checkpoint's settings (refused here,
    before any work, when it cannot serve them); turns on the compilation cache."""
    config = replace(
        config, model=resolve_model(config.model, load_format=config.load_format,
                                    revision=config.revision,
                                    download_dir=config.download_dir),
        tokenizer=config.tokenizer and resolve_tokenizer(config.tokenizer,
                                                         download_dir=config.download_dir))
    config = resolve_converted(config)
    enable_compilation_cache(config.compilation_cache_dir)
    if config.load_format != "dummy" and not os.path.isdir(config.model):
        raise ValueError(f"model path {config.model!r} does not exist or is not a directory")
    return config


@dataclass(frozen=True)
class ReplicaShape:
    """One replica before any weight: its config (platform defaults resolved), model
    config, 1xM mesh and layout."""
    config: EngineConfig
    model_config: ModelConfig
    mesh: Mesh
    layout: EngineLayout


def replica_shape(config: EngineConfig, mc: ModelConfig, mesh: Mesh | None) -> ReplicaShape:
    """mesh None: make_mesh(config.mesh), which must then have D = 1."""
    mesh = mesh if mesh is not None else make_mesh(config.mesh)
    if mesh.shape[DATA] != 1:
        raise ValueError(f"EngineCore runs one replica (a 1xM mesh), got mesh "
                         f"{dict(mesh.shape)}; jaxserve.engine.data_parallel."
                         f"make_engine builds D replicas")
    config = config.for_platform(mesh.devices.flat[0].platform)
    return ReplicaShape(config, mc, mesh, engine_layout(config, mc, mesh))


@dataclass(frozen=True)
class EngineParts:
    """What EngineCore runs: the replica, its loaded model, cache plan and runner (its
    programs compiled unless enforce_eager), and the scheduler's settings."""
    shape: ReplicaShape
    model: Any
    params: Any
    weight_bytes: int
    weight_bytes_per_device: int
    plan: CachePlan
    runner: ModelRunner
    scheduler_config: SchedulerConfig


def build_parts(shape: ReplicaShape, progress: StartupProgress, *,
                agree_num_pages: Callable[[int], int] | None = None,
                images: ImageFront | None = None) -> EngineParts:
    """Loads the weights (and a model drafter's), sizes the caches, builds the runner and
    compiles its programs, telling `progress` each phase. agree_num_pages: several
    processes must build the same cache shape (multi-host: the smallest count of all).
    images: the front door's image side; the vision tower is loaded when it takes images."""
    config, mc, mesh, layout = shape.config, shape.model_config, shape.mesh, shape.layout
    progress.set_phase(LOADING_WEIGHTS, f"loading the weights of {config.model}")
    loaded = load_model(config, layout, mesh, on_progress=partial(_report_loading, progress))
    drafter = load_drafter(config, layout, mesh)
    side = images and load_vision(images, layout.dtype, config.num_batched_tokens,
                                  mc.hidden_size, mc.image_attention_both_ways)
    vision, vision_figures = side or (None, None)
    if mc.linear_attention_layers:
        logger.info("hybrid model: %d of %d layers are linear attention with recurrent "
                    "state, the other %d keep KV pages; prefix caching %s",
                    len(mc.linear_attention_layers), mc.num_layers,
                    len(mc.full_attention_layers),
                    "keeps state snapshots at page boundaries"
                    if config.enable_prefix_caching else "is off")
    lora = lora_store(config, layout, loaded.model)
    if lora is not None:   # before the caches are sized from the memory left
        lora.allocate(mesh)
    progress.set_phase(ALLOCATING_KV_CACHE, "sizing and allocating the KV cache")
    # Sized per device: each device holds kv_heads / M heads of every page.
    plan = layout_cache_plan(config, layout, mesh.devices.flat[0],
                             drafter_specs=drafter.cache_specs if drafter else (),
                             vision=vision_figures)
    if agree_num_pages is not None:
        plan = plan.with_num_pages(agree_num_pages(plan.num_pages))
    logger.info("%s", plan.describe())
    if config.speculative_config is not None:
        logger.info("%s", config.speculative_config.describe())
    if config.kv_offloading_size:
        check_host_tier(config, plan)
    runner = build_runner(config, layout, plan, model=loaded.model, params=loaded.params,
                          mesh=mesh, drafter=drafter, lora=lora, vision=vision)
    sched = scheduler_config(config, layout, plan, vision)
    tier = None
    if config.kv_offloading_size:   # before warmup, which compiles its copy programs
        tier = attach_host_tier(config, runner)
        logger.info("%s", describe(tier, plan))
    if config.enforce_eager:   # each program compiles when a step first needs it
        logger.info("enforce_eager: no warmup; programs compile on first use")
    else:
        progress.set_phase(COMPILING, "listing the programs to compile")
        runner.warmup(partial(_report_compiling, progress))
    if tier is not None:   # after warmup, which times a restore
        cost = restore_cost(tier, plan, loaded.params, mc, mesh.devices.flat[0].platform,
                            runner.prefill_s_per_token, runner.attention_s_per_pair,
                            runner.drafter.params if runner.drafter else None)
        logger.info("%s", describe_cost(tier, cost, plan, runner.attention_s_per_pair > 0))
        sched = replace(sched, **host_tier_slice(tier, plan, cost))
    return EngineParts(shape, loaded.model, loaded.params, loaded.weight_bytes,
                       loaded.weight_bytes_per_device, plan, runner, sched)


def build_runner(config: EngineConfig, layout: EngineLayout, plan: CachePlan, *, model: Any,
                 params: Any, mesh: Mesh, drafter: DrafterParts | None,
                 abstract: bool = False, lora: LoRAStore | None = None,
                 vision: VisionParts | None = None) -> ModelRunner:
    """The replica's runner (and its model drafter's, if any); abstract: nothing
    allocated, for lowering only. lora: the adapters' store (default: made here when
    LoRA is on)."""
    return ModelRunner(
        runner_config(config, layout, plan), model=model, params=params, mesh=mesh,
        abstract=abstract, caches_after_compile=not config.enforce_eager,
        lora=lora or lora_store(config, layout, model), vision=vision,
        drafter=drafter and drafter.build(plan, config, layout, target_model=model, mesh=mesh,
                                          abstract=abstract))


def lora_store(config: EngineConfig, layout: EngineLayout, model: Any) -> LoRAStore | None:
    """The served adapters' store (runner/lora_store.py), None with LoRA off. The stacks'
    dtype: --lora-dtype, auto = what the projections' dots take (layout.matmul_dtype: a
    bf16 model's own dtype on a CPU with native bf16 dots, where bf16 stacks halve the
    adapters' bytes and run the CPU's all-slots pass as fast as the base dots)."""
    if not config.enable_lora:
        return None
    dtype = (layout.matmul_dtype or layout.compute_dtype or layout.dtype) \
        if config.lora_dtype == "auto" else jnp.dtype(config.lora_dtype)
    return LoRAStore(LoRAConfig(config.max_loras, config.max_lora_rank,
                                config.max_cpu_loras or config.max_loras, dtype),
                     model, layout.rules, config.model,
                     kv_head_repeats(layout.model_config, layout.model_axis))


def _report_loading(progress: StartupProgress, done: int, total: int) -> None:
    progress.advance(done, total, f"loaded {done / 2**30:.2f} of {total / 2**30:.2f} GiB "
                                  "of weights")


def _report_compiling(progress: StartupProgress, done: int, total: int) -> None:
    detail = (f"compiling program {done + 1} of {total}" if done < total
              else f"compiled {total} programs, running each once")
    progress.advance(done, total, detail)
