"""What an engine replica builds before any weight exists: one owner for the choices
EngineCore makes from its config, the model config and its mesh.

EngineCore builds its model, KV pages and ModelRunner through these functions
(build/parts.py), and `python -m jaxserve.plan --compile` builds the same things for a
mesh of abstract TPU chips (abstract params, caches never allocated), so the planner
compiles exactly the programs the engine would run.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.build.cache_plan import CachePlan, plan_caches, require_one_sequence
from jaxserve.build.kernel_choice import (KernelChoice, choose_attention,
                                          choose_linear_attention, choose_matmul)
from jaxserve.build.kv_budget import DeviceMemory, activation_bytes, cache_budget_bytes
from jaxserve.build.vision import VisionFigures, vision_budget
from models.cache_spec import CacheSpec, layer_cache_specs
from models.config import ModelConfig, WeightQuant, resolve_weight_quant
from models.registry import (build_model, compute_dtype, matmul_dtype, resolve_dtype,
                             resolve_kv_dtype)
from models.weights import param_logical_axes
from pallas_kernels.ragged_paged_attention import is_quantized, resolve_backend
from sharding import (MODEL, check_model_axis, mesh_rules, param_shardings,
                      with_stored_kv_heads)

logger = logging.getLogger("jaxserve")

@dataclass(frozen=True)
class EngineLayout:
    """One replica's choices on a 1xM mesh. Byte figures are per device."""
    model_config: ModelConfig     # as published
    dtype: Any
    kv_dtype: Any
    weight_quant: WeightQuant | None  # how the weights are stored (models/quantization.py)
    max_model_len: int
    model_axis: int               # M: tensor-parallel devices of the replica
    kv_heads: int                 # as stored on this mesh (sharding.kv_head_layout)
    global_kv_heads: int          # Gemma 4's global layers' own count, as stored (0: none)
    attention_backend: str        # resolved for the mesh's platform
    rules: dict[str, str | None]  # the rules table for this model and M
    cache_specs: tuple[CacheSpec, ...]  # one per layer (models/cache_spec.py)
    activation_bytes: int         # estimated peak temporaries of a program (kv_budget)
    scan_layers: bool             # EngineConfig.scan_layers (for_platform resolved it)
    num_speculative_tokens: int = 0   # drafts a row verifies in a step (0: none)
    expert_parallel: bool = False     # MoE experts split whole over the model axis
    # What the model computes in: `dtype`, except float32 on CPU for a narrow float
    # dtype (XLA:CPU has no 16-bit float arithmetic: models/weights.widen_params).
    # The weights are read and converted in `dtype`; the KV cache stays kv_dtype.
    compute_dtype: Any = None
    # What the projections' dots take: compute_dtype, or on a CPU with native bf16 dots
    # a bf16 model's own dtype (models/registry.matmul_dtype; its kernels stay bf16).
    matmul_dtype: Any = None
    # What runs each part, per layer group (build/kernel_choice.py), for the start-up log.
    kernels: tuple[KernelChoice, ...] = ()

    @property
    def run_config(self) -> ModelConfig:
        """The model as it runs on this mesh: KV heads as stored, weights as quantized,
        per-head KV scales when the cache is quantized."""
        return replace(self.model_config, num_kv_heads=self.kv_heads,
                       full_num_kv_heads=self.global_kv_heads, weight_quant=self.weight_quant,
                       kv_cache_quantized=is_quantized(self.kv_dtype),
                       expert_parallel=self.expert_parallel,
                       max_decode_tokens=1 + self.num_speculative_tokens)


def engine_layout(config: EngineConfig, mc: ModelConfig, mesh: Mesh) -> EngineLayout:
    """ValueError for a max_model_len past the model's or a model axis that does not
    divide the model (sharding.check_model_axis: also expert parallelism it cannot
    serve)."""
    return layout_for(config, mc, mesh.devices.flat[0].platform, mesh.shape[MODEL])


def layout_for(config: EngineConfig, mc: ModelConfig, platform: str, m: int, *,
               check_kernels: bool = True) -> EngineLayout:
    """engine_layout for `platform` and a model axis of m devices, with no mesh (the
    planner's). check_kernels: refuse what the platform's attention kernels cannot run
    (the planner reports the TPU's compiler limits instead of refusing)."""
    config = config.for_platform(platform)   # (idempotent: the engine resolved it already)
    dtype = resolve_dtype(config.dtype, mc)
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype)
    weight_quant = resolve_weight_quant(config.quantization, mc.weight_quant,
                                        config.activation_quantization)
    max_model_len = config.max_model_len or mc.max_position_embeddings
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={mc.max_position_embeddings}")
    ep = config.enable_expert_parallel
    check_model_axis(mc, m, expert_parallel=ep)
    if ep:
        logger.info("expert parallel: %d experts per device (of %d), each whole",
                    mc.num_experts // m, mc.num_experts)
    stored = with_stored_kv_heads(mc, m)
    compute, matmul = compute_dtype(dtype, platform), matmul_dtype(dtype, platform)
    specs = layer_cache_specs(stored, kv_dtype=kv_dtype, conv_state_dtype=compute)
    # Every kernel is chosen here, once: a combination no kernel takes is refused or
    # falls back with a log line (build/kernel_choice.py), never silently.
    backend, attention = choose_attention(
        stored, platform=platform, requested=config.attention_backend,
        backend=resolve_backend(config.attention_backend, platform), kv_dtype=kv_dtype,
        page_size=config.page_size, num_heads=mc.num_heads, refuse=check_kernels)
    kernels = (attention + choose_linear_attention(stored, platform=platform, backend=backend)
               + choose_matmul(mc, dtype=dtype, compute_dtype=compute,
                               matmul_dtype=matmul,
                               weight_quant=weight_quant))
    for layer in attention_shapes(stored) if check_kernels else ():
        if platform == "tpu" and backend == "pallas":
            why = tpu_kernel_limit_error(mc, stored.layer_num_kv_heads(layer),
                                         num_tokens=config.num_batched_tokens,
                                         rows=config.max_num_seqs, max_model_len=max_model_len,
                                         page_size=config.page_size)
            if why:
                raise ValueError(why)
    act = activation_bytes(mc, m, config.num_batched_tokens, config.max_num_seqs,
                           jnp.dtype(dtype).itemsize, max_model_len)
    spec = config.speculative_config
    return EngineLayout(mc, dtype, kv_dtype, weight_quant, max_model_len, m, stored.num_kv_heads,
                        stored.full_num_kv_heads, backend, mesh_rules(mc, m, ep), specs, act,
                        config.scan_layers, spec.num_speculative_tokens if spec else 0, ep,
                        compute, matmul, kernels)


def attention_shapes(mc: ModelConfig) -> list[int]:
    """One KV layer of each distinct (head dim, KV heads): what the start-up checks of
    the attention kernels need to see."""
    seen: dict[tuple[int, int], int] = {}
    for i in mc.kv_layers():
        seen.setdefault((mc.layer_head_dim(i), mc.layer_num_kv_heads(i)), i)
    return list(seen.values())


def tpu_kernel_limit_error(mc: ModelConfig, kv_heads: int, *, num_tokens: int, rows: int,
                           max_model_len: int, page_size: int) -> str | None:
    """Why the engine's largest step would not compile for TPU (a compiler limit the
    kernels cannot stream around), with the fix; None when it compiles. kv_heads: as
    stored on the mesh."""
    # (the TPU kernels' modules load Mosaic: only a TPU layout needs them)
    from pallas_kernels.gated_delta import tpu as gdn_tpu
    from pallas_kernels.ragged_paged_attention import tpu as rpa_tpu
    return (rpa_tpu.smem_limit_error(num_tokens, rows, mc.num_heads // kv_heads,
                                     -(-max_model_len // page_size))
            or (gdn_tpu.smem_limit_error(rows) if mc.linear_attention_layers else None))


def build_layout_model(layout: EngineLayout) -> nn.Module:
    return build_model(layout.run_config, dtype=layout.dtype,
                       attention_backend=layout.attention_backend, scan_layers=layout.scan_layers)


def layout_param_shardings(model: nn.Module, mesh: Mesh, layout: EngineLayout) -> Any:
    """NamedShardings of `model`'s parameters under the layout's rules table."""
    return param_shardings(param_logical_axes(model), mesh, layout.rules)


def layout_cache_plan(config: EngineConfig, layout: EngineLayout, device: Any,
                      memory: DeviceMemory | None = None,
                      drafter_specs: tuple[CacheSpec, ...] = (),
                      vision: VisionFigures | None = None) -> CachePlan:
    """The replica's cache plan (build/cache_plan.py); ValueError when one sequence of
    max_model_len does not fit."""
    return require_one_sequence(cache_plan_for(config, layout, device, memory, drafter_specs,
                                               vision))


def cache_plan_for(config: EngineConfig, layout: EngineLayout, device: Any,
                   memory: DeviceMemory | None = None,
                   drafter_specs: tuple[CacheSpec, ...] = (),
                   vision: VisionFigures | None = None) -> CachePlan:
    """The cache plan of the engine and of the planner, which may not fit one sequence.
    memory: the device's memory and what the weights hold of it; None asks `device`.
    drafter_specs: a speculative model drafter's KV layers, which keep KV on the same
    pages (build/drafter_loader.py). vision: the image side's figures, when it serves
    images (its encoder cache and calls come out of the budget: build/vision.py)."""
    if config.num_pages is not None:
        budget, cap = None, False
    else:
        later, activation = vision_budget(vision, layout.activation_bytes)
        budget, cap = cache_budget_bytes(
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            hbm_utilization=config.hbm_utilization, activation_bytes=activation,
            device=device, memory=memory, later_bytes=later)
    return plan_caches(
        layout.cache_specs + tuple(drafter_specs), model_axis=layout.model_axis,
        page_size=config.page_size, max_num_seqs=config.max_num_seqs,
        max_model_len=layout.max_model_len, max_num_batched_tokens=config.num_batched_tokens,
        num_pages=config.num_pages, budget_bytes=budget, cap_at_demand=cap,
        prefix_caching=config.enable_prefix_caching,
        spec_backups=config.speculative_config is not None)

