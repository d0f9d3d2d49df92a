"""`python -m jaxserve.plan`: what a model needs on a "DxM" mesh, computed from its config.

    python -m jaxserve.plan --model qwen3-8b --mesh 1x8 --hbm 80GiB
    python -m jaxserve.plan --model qwen3-8b --mesh 1x8 --target tpu-v6e --compile [all] [--json]

--compile builds the engine for a TPU target with abstract weights and compiles its
warmup programs with the real XLA:TPU compiler on this host (planning/plan_compile.py).

Every figure comes from the model config and the same code the engine runs:
parameter shapes from the flax model (jax.eval_shape, nothing allocated), their
placement from sharding/rules.py (including KV heads replicated when M does not
divide them), the KV page layout of the cache. Nothing here is a hand-typed size
except the built-in configs (jaxserve/model_configs.py), copied from their
published config.json.

Memory: the engine's own rule (build/kv_budget.py), as vLLM's
--gpu-memory-utilization: the engine gets hbm_utilization (0.9) of the device's memory
(--hbm, or a --target's usable HBM) for everything it holds; of that the weights come
first, then a reserve for the programs' temporaries (the estimated peak of the forward
at the largest token bucket or of the sampler over max_num_seqs rows, at least 5% of
the engine's share), and the caches get the rest. Hybrid models (Qwen3.5/3.6) keep a
KV cache only in their full-attention layers; their linear-attention layers carry a
fixed recurrent state per sequence, for which the engine takes max_num_seqs + 1 slots
(twice max_num_seqs with speculative decoding: each sequence keeps a backup) and the
prefix cache's snapshots out of that budget first and pages the rest. Models with
sliding-window layers (Gemma 4) give those layers pages of their own, enough for
max_num_seqs windows and one step, taken from the budget before the global layers'
pages. A model drafter (--speculative-config mtp or draft_model) adds its weights and
its KV on every page. The plan is made from the same EngineConfig, layout and cache
planning as the engine's (jaxserve/build/layout.py), so the planner's "fits" is the
engine's. Communication: Megatron
tensor parallelism all-reduces the [tokens, hidden] activations twice per layer
(after o_proj and after the MLP's down_proj) plus once for the vocab-parallel
embedding; a ring all-reduce moves 2 (M-1)/M of the buffer through every device's
link in each direction.
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict

from jaxserve.build.drafter_loader import drafter_model
from jaxserve.build.layout import (attention_shapes, build_layout_model, cache_plan_for,
                                   layout_for, tpu_kernel_limit_error)
from jaxserve.build.parts import lora_store
from jaxserve.build.vision import (VisionFigures, vision_budget,
                                  vision_figures)
from jaxserve.config import EngineConfig
from jaxserve.build.cache_plan import CachePlan
from jaxserve.build.kv_budget import DeviceMemory, MemorySplit, device_memory, memory_split
from jaxserve.engine.protocol import EngineInfo
from jaxserve.multimodal.front import image_front
from jaxserve.planning.plan_format import format_plan
from models.cache_spec import PagedKVSpec, RecurrentStateSpec, SharedKVSpec
from models.config import ModelConfig, WeightQuant
from models.registry import build_model
from models.weights import abstract_params, param_logical_axes
from pallas_kernels.ragged_paged_attention import is_quantized
from sharding import MODEL, kv_head_repeats, logical_to_mesh, mesh_rules, with_stored_kv_heads
from sharding.mesh import parse_mesh

# NVLink 4 on an H100 SXM: 18 links x 25 GB/s = 450 GB/s per direction per GPU.
DEFAULT_LINK_GBPS = 450.0
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """"80GiB", "80GB", "85899345920" -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number with an optional unit "
                         f"(B, KB, MB, GB, KiB, MiB, GiB, ...)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class WeightFigures:
    """Parameter count and bytes of one replica's weights on a 1xM mesh."""
    num_params: int
    weight_bytes: int                 # one replica, all devices
    bytes_per_device: int
    replicated_bytes: int             # of bytes_per_device, held by every device


def weight_figures(mc: ModelConfig, m: int, dtype: str,
                   weight_quant: WeightQuant | None = None,
                   kv_cache_quantized: bool = False, expert_parallel: bool = False
                   ) -> WeightFigures:
    """From the flax model's parameter shapes and dtypes (jax.eval_shape: nothing
    allocated; quantized kernels in their own dtype, their scales float32, the rest in
    `dtype`; a quantized KV cache adds its float32 scales) and their placement by
    sharding/rules.py."""
    # Layers under scan: the same parameters, stacked, traced once (not once per layer).
    module = build_model(replace(with_stored_kv_heads(mc, m), weight_quant=weight_quant,
                                 kv_cache_quantized=kv_cache_quantized), dtype, "reference",
                         scan_layers=True)
    return module_weight_figures(module, mc, m, expert_parallel)


def module_weight_figures(module: Any, mc: ModelConfig, m: int, expert_parallel: bool = False
                          ) -> WeightFigures:
    """A flax module's parameters on a 1xM mesh under `mc`'s rules table (the model's,
    or a drafter's)."""
    repeats = kv_head_repeats(mc, m)
    shapes = flatten_dict(abstract_params(module))
    axes = flatten_dict(param_logical_axes(module))
    rules = mesh_rules(mc, m, expert_parallel)
    per_device = replicated = total = num_params = 0
    for path, sds in shapes.items():
        itemsize = sds.dtype.itemsize
        nbytes = sds.size * itemsize
        split = m if MODEL in tuple(logical_to_mesh(axes[path], rules)) else 1
        # Replicated KV heads are the same parameters again: count them once.
        repeat = next((r for axis, r in repeats.items() if axis in tuple(axes[path])), 1)
        unique = sds.size // repeat
        num_params += unique
        total += unique * itemsize
        per_device += nbytes // split
        replicated += nbytes if split == 1 else 0
    return WeightFigures(num_params, total, per_device, replicated)


@dataclass(frozen=True)
class Plan:
    model: str
    mesh: tuple[int, int]
    dtype: str
    kv_dtype: str
    quantization: str | None          # the weights' (WeightQuant.method), None: unquantized
    num_params: int
    weight_bytes: int                 # one replica, all devices
    weight_bytes_per_device: int
    replicated_param_bytes: int       # of weight_bytes_per_device, held by every device
    kv_heads: int                     # as the model has them
    kv_heads_stored: int              # across the model axis (replicated heads when K % M)
    kv_bytes_per_token_per_device: int   # the global (full-attention) layers'
    num_layers: int
    full_attention_layers: int        # global layers with a KV cache of their own
    state_bytes_per_seq: int          # hybrid: recurrent state of one sequence, whole
    state_bytes_per_seq_per_device: int
    state_layout: str                 # what the state is made of, for the printout
    hidden_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    activation_bytes: int             # estimated peak of one step, per device
    hbm_bytes: int | None
    hbm_utilization: float
    link_gbps: float
    # The engine's cache plan (build/cache_plan.py) for this memory; None when the
    # device memory is unknown and no cache size was given.
    cache: CachePlan | None = None
    compiler_limit: str | None = None  # TPU: why the largest step would not compile
    # Gemma 4's global layers' own KV heads (0: as kv_heads), and as stored on the mesh.
    global_kv_heads: int = 0
    global_kv_heads_stored: int = 0
    # Sliding-window layers (Gemma 4) with a KV cache of their own, and their window.
    sliding_attention_layers: int = 0
    sliding_kv_bytes_per_token_per_device: int = 0
    sliding_window: int | None = None
    kv_shared_layers: int = 0         # layers that read another layer's KV (own none)
    expert_parallel: bool = False     # MoE experts split whole over the model axis
    # Speculative decoding: what it is (SpeculativeConfig.describe), and a model
    # drafter's weights per device (its KV is in the cache plan's pages).
    speculative: str | None = None
    drafter_weight_bytes_per_device: int = 0
    kv_cache_memory_bytes: int | None = None   # given in place of the memory rule
    host_tier_bytes: int = 0          # the prefix cache's host tier (--kv-offloading-size)
    # LoRA (--enable-lora): the adapters' slots (what they are) and their stacks' bytes
    # per device, held beside the weights (runner/lora_store.py).
    lora: str | None = None
    lora_bytes_per_device: int = 0
    # Images (a checkpoint directory whose front takes them): the tower's weights, the
    # encoder cache and the largest encoder call's activations, per device (replicated).
    vision: VisionFigures | None = None

    @property
    def memory(self) -> MemorySplit | None:
        """The device's memory as the engine splits it (None when unknown)."""
        if self.hbm_bytes is None:
            return None
        later, activation = vision_budget(self.vision, self.activation_bytes)
        return memory_split(self.hbm_bytes, self.hbm_utilization,
                            self.weight_bytes_per_device + self.drafter_weight_bytes_per_device
                            + self.lora_bytes_per_device
                            + (self.vision.weight_bytes if self.vision else 0),
                            activation, self.hbm_bytes, later)

    @property
    def kv_budget_bytes(self) -> int:
        """What the engine gives the caches (KV pages, state slots and snapshots): the
        memory split's, or --kv-cache-memory-bytes; with the device memory unknown, what
        the cache plan took."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        if self.memory is None:
            return self.cache.total_bytes if self.cache else 0
        return self.memory.cache_bytes

    @property
    def reserve_bytes(self) -> int:
        return self.memory.reserve_bytes if self.memory else 0

    @property
    def has_state(self) -> bool:
        """The caches hold recurrent state beside the KV pages (state slots to size)."""
        return self.state_bytes_per_seq > 0

    @property
    def state_slots(self) -> int:
        """Recurrent-state slots the engine allocates up front: max_num_seqs + 1."""
        return self.cache.num_state_slots if self.cache else 0

    @property
    def state_budget_bytes(self) -> int:
        return self.cache.state_bytes if self.cache else 0

    @property
    def page_budget_bytes(self) -> int:
        """The KV budget less the state slots: what the KV pages get."""
        return max(0, self.kv_budget_bytes - self.state_budget_bytes)

    @property
    def kv_tokens(self) -> int:
        """Tokens the engine's KV pages hold (the cache plan's; 0 when unknown)."""
        return self.cache.kv_tokens if self.cache else 0

    @property
    def max_sequences(self) -> int:
        """Full-length (max_model_len) sequences that fit at once; a hybrid model also
        runs at most max_num_seqs (one state slot each)."""
        seqs = self.kv_tokens // self.max_model_len
        if self.has_state and self.state_budget_bytes > self.kv_budget_bytes:
            return 0
        return min(seqs, self.max_num_seqs) if self.has_state else seqs

    @property
    def memory_fits(self) -> bool:
        """max_num_seqs sequences of max_model_len tokens fit next to the weights."""
        return (self.cache is not None and self.kv_budget_bytes > 0
                and self.state_budget_bytes <= self.kv_budget_bytes
                and self.max_num_seqs * self.max_model_len <= self.kv_tokens)

    @property
    def fits(self) -> bool:
        """The memory fits and no compiler limit stands in the way."""
        return self.memory_fits and self.compiler_limit is None

    @property
    def allreduce_bytes_per_token_per_layer(self) -> int:
        act = jnp.dtype(self.dtype).itemsize
        return 0 if self.mesh[1] == 1 else 2 * self.hidden_size * act

    def memory_json(self) -> dict | None:
        """Where each byte of a device goes (None when its memory is unknown)."""
        split, c = self.memory, self.cache
        if split is None:
            return None
        held = c.total_bytes if c else 0
        return {"device_bytes": split.device_bytes, "utilization": self.hbm_utilization,
                "engine_bytes": split.engine_bytes,
                "weight_bytes": self.weight_bytes_per_device,
                "drafter_weight_bytes": self.drafter_weight_bytes_per_device,
                "vision_weight_bytes": self.vision.weight_bytes if self.vision else 0,
                "kv_page_bytes": c.kv_bytes if c else 0,
                "state_slot_bytes": (c.state_bytes - c.snapshot_bytes) if c else 0,
                "snapshot_bytes": c.snapshot_bytes if c else 0,
                "encoder_cache_bytes": split.later_bytes,
                "reserve_bytes": split.reserve_bytes,
                "activation_estimate_bytes": self.activation_bytes,
                # the budget's remainder below one page, or one the engine does not take
                "unused_bytes": max(0, split.engine_bytes - split.weight_bytes
                                    - split.later_bytes - split.reserve_bytes - held),
                "outside_engine_bytes": split.outside_bytes}

    def to_json(self) -> dict:
        """The fields, the cache plan, and the figures derived from them that the printout
        shows (KV capacity, full-length sequences that fit, whether it fits, where the
        device's memory goes)."""
        c = self.cache
        return {**asdict(self), "memory": self.memory_json(),
                "kv_budget_bytes": self.kv_budget_bytes,
                "kv_tokens": self.kv_tokens, "max_concurrency": self.max_sequences,
                "state_slots": self.state_slots, "memory_fits": self.memory_fits,
                "fits": self.fits,
                "sliding_pages_per_seq": c.sliding_pages_per_seq if c else 0,
                "sliding_kv_saved_bytes": c.sliding_saved_bytes if c else 0,
                "full_history_kv_tokens": c.full_history_kv_tokens if c else 0}

    def allreduce_seconds(self, nbytes: float) -> float:
        m = self.mesh[1]
        return 0.0 if m == 1 else 2 * (m - 1) / m * nbytes / (self.link_gbps * 1e9)


def plan_from_config(config: EngineConfig, mc: ModelConfig, *, hbm_bytes: int | None = None,
                     platform: str = "gpu", link_gbps: float = DEFAULT_LINK_GBPS,
                     weights: WeightFigures | None = None, cache: CachePlan | None = None,
                     label: str | None = None) -> Plan:
    """The plan of the engine `config` would start on one `platform` ("gpu", "tpu")
    device of hbm_bytes (None: unknown): the engine's layout, model drafter and cache
    plan (jaxserve/build/layout.py), with abstract weights. weights: the parameter
    figures if known (else from the flax model); cache: a running engine's plan. On
    "tpu", also the limits of the TPU compiler the kernels cannot stream around
    (compiler_limit)."""
    config = config.for_platform(platform)
    d, m = parse_mesh(config.mesh or "1x1")
    layout = layout_for(config, mc, platform, m, check_kernels=False)
    dt = jnp.dtype(layout.dtype)
    ep = config.enable_expert_parallel
    w = weights or weight_figures(mc, m, dt.name, layout.weight_quant,
                                  is_quantized(layout.kv_dtype), ep)
    # (weights are abstract here: a draft model named by an alias needs no files)
    drafter = drafter_model(replace(config, load_format="dummy"), layout, platform,
                            check_kernels=False)
    drafter_bytes = module_weight_figures(drafter.model, drafter.layout.model_config, m
                                          ).bytes_per_device if drafter else 0
    lora, lora_bytes = _lora_slots(config, layout, m)
    vision = _vision(config, mc, layout)
    if cache is None and (config.num_pages or config.kv_cache_memory_bytes or hbm_bytes):
        # The tower is loaded before the caches are sized, so the engine's budget counts
        # it as held; its encoder cache and calls come after (cache_plan_for takes them).
        memory = DeviceMemory(hbm_bytes, hbm_bytes,
                              w.bytes_per_device + drafter_bytes + lora_bytes
                              + (vision.weight_bytes if vision else 0)) \
            if hbm_bytes else None
        cache = cache_plan_for(config, layout, None, memory,
                               drafter.cache_specs if drafter else (), vision)
    specs = layout.cache_specs
    sliding = [s for s in specs if isinstance(s, PagedKVSpec) and s.sliding_window is not None]
    state = sum(s.bytes_per_slot() for s in specs if isinstance(s, RecurrentStateSpec))
    limit = None
    if platform == "tpu":
        stored = with_stored_kv_heads(mc, m)
        limit = next(filter(None, (tpu_kernel_limit_error(
            mc, stored.layer_num_kv_heads(i), num_tokens=config.num_batched_tokens,
            rows=config.max_num_seqs, max_model_len=layout.max_model_len,
            page_size=config.page_size) for i in attention_shapes(stored))), None)
    spec = config.speculative_config
    return Plan(
        model=f"{label or config.model} ({mc.architecture})", mesh=(d, m), dtype=dt.name,
        kv_dtype=jnp.dtype(layout.kv_dtype).name,
        quantization=layout.weight_quant.method if layout.weight_quant else None,
        num_params=w.num_params, weight_bytes=w.weight_bytes,
        weight_bytes_per_device=w.bytes_per_device, replicated_param_bytes=w.replicated_bytes,
        kv_heads=mc.num_kv_heads, kv_heads_stored=layout.kv_heads,
        kv_bytes_per_token_per_device=sum(
            s.bytes_per_token() for s in specs
            if isinstance(s, PagedKVSpec) and s.sliding_window is None) // m,
        global_kv_heads=mc.full_num_kv_heads, global_kv_heads_stored=layout.global_kv_heads,
        num_layers=mc.num_layers, full_attention_layers=len(mc.full_attention_layers),
        state_bytes_per_seq=state, state_bytes_per_seq_per_device=state // m,
        state_layout=_state_layout(mc, dt.name), hidden_size=mc.hidden_size,
        max_model_len=layout.max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.num_batched_tokens,
        activation_bytes=layout.activation_bytes, hbm_bytes=hbm_bytes,
        hbm_utilization=config.hbm_utilization, link_gbps=link_gbps, cache=cache,
        compiler_limit=limit, sliding_attention_layers=len(sliding),
        sliding_kv_bytes_per_token_per_device=sum(s.bytes_per_token() for s in sliding) // m,
        sliding_window=mc.sliding_window if sliding else None,
        kv_shared_layers=sum(isinstance(s, SharedKVSpec) for s in specs),
        expert_parallel=ep, speculative=spec.describe() if spec else None,
        drafter_weight_bytes_per_device=drafter_bytes,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        host_tier_bytes=config.kv_offloading_bytes, lora=lora,
        lora_bytes_per_device=lora_bytes, vision=vision)


def _vision(config: EngineConfig, mc: ModelConfig, layout: Any) -> VisionFigures | None:
    """The vision side's figures when the model is a checkpoint directory that serves
    images (built-in configs leave the tower out: none)."""
    if not config.model or not os.path.isdir(config.model):
        return None
    front = image_front(config)
    if front.refusal is not None:
        return None
    return vision_figures(front, layout.dtype, config.num_batched_tokens, mc.hidden_size,
                          mc.image_attention_both_ways)


def _lora_slots(config: EngineConfig, layout, m: int) -> tuple[str | None, int]:
    """With --enable-lora: what the adapters' slots are, and their bytes per device."""
    if not config.enable_lora:
        return None, 0
    store = lora_store(config, layout, build_layout_model(layout))
    c = store.config
    nbytes = store.bytes_per_device(m)
    return (f"LoRA: {c.max_loras} adapter slot(s) (+ the empty slot 0) of rank "
            f"{c.max_rank} over {len(store.targets)} projections, "
            f"{jnp.dtype(c.dtype).name}: {nbytes / 2**30:.3f} GiB per device"), nbytes


def make_plan(mc: ModelConfig, *, model: str, mesh: str, hbm_bytes: int | None = None,
              link_gbps: float = DEFAULT_LINK_GBPS, weights: WeightFigures | None = None,
              platform: str | None = None, cache: CachePlan | None = None,
              prefix_caching: bool = True, **engine: Any) -> Plan:
    """plan_from_config for EngineConfig(model=model, mesh=mesh, **engine) (its field
    names: dtype, max_model_len, max_num_seqs, hbm_utilization, speculative_config, ...).
    prefix_caching: enable_prefix_caching. platform None: a GPU."""
    config = EngineConfig(model=model, mesh=mesh, enable_prefix_caching=prefix_caching,
                          compilation_cache_dir=None, **engine)
    return plan_from_config(config, mc, hbm_bytes=hbm_bytes, platform=platform or "gpu",
                            link_gbps=link_gbps, weights=weights, cache=cache)


def _state_layout(mc, dtype: str) -> str:
    """What a hybrid model's recurrent state is made of, for the printout ("" if none).
    The conv state is in the model dtype, the delta-rule state float32; both are split
    by key-head group over M (sharding.check_model_axis requires M to divide them)."""
    if not mc.linear_attention_layers:
        return ""
    return (f"{len(mc.linear_attention_layers)} linear-attention layers x (conv "
            f"{mc.linear_conv_kernel_dim - 1} x {mc.linear_conv_dim} {dtype} + delta rule "
            f"{mc.linear_num_value_heads} x {mc.linear_key_head_dim} x "
            f"{mc.linear_value_head_dim} float32)")


def plan_for_engine(info: EngineInfo) -> str:
    """The plan of a running engine (its EngineInfo), for the server's start-up log: its
    own config and cache plan, the device's memory from its allocator (unknown on
    CPU)."""
    device = jax.devices()[0]
    memory = device_memory(device) if device.platform != "cpu" else None
    plan = plan_from_config(info.config, info.model_config,
                            hbm_bytes=memory.device_bytes if memory else None,
                            platform=device.platform, cache=info.cache_plan)
    return format_plan(plan)

