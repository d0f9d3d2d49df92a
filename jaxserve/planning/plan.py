"""`python -m jaxserve.plan`: what a model needs on a "DxM" mesh, computed from its config.

    python -m jaxserve.plan --model qwen3-8b --mesh 1x8 --hbm 80GiB
    python -m jaxserve.plan --model qwen3-8b --mesh 1x8 --target tpu-v6e --compile [all] [--json]

--compile builds the engine for a TPU target with abstract weights and compiles its
warmup programs with the real XLA:TPU compiler on this host (jaxserve/plan_compile.py).

Every figure comes from the model config and the same code the engine runs:
parameter shapes from the flax model (jax.eval_shape, nothing allocated), their
placement from sharding/rules.py (including KV heads replicated when M does not
divide them), the KV page layout of the cache. Nothing here is a hand-typed size
except the built-in configs (jaxserve/model_configs.py), copied from their
published config.json.

Memory: the engine's own rule -- the KV cache gets hbm_utilization (0.9) of the
device memory (--hbm) that the weights leave, but never the estimated peak of a
program's temporaries (the forward's at the largest token bucket or the
sampler's over max_num_seqs rows); the rest is the reserve for activations,
XLA's workspace and fragmentation. Hybrid models (Qwen3.5/3.6) keep a KV cache only in
their full-attention layers; their linear-attention layers carry a fixed
recurrent state per sequence, for which the engine takes max_num_seqs + 1 slots
out of that budget first and pages the rest. Models with sliding-window layers
(Gemma 4) give those layers pages of their own, enough for max_num_seqs windows and
one step, taken from the budget before the global layers' pages. Communication: Megatron
tensor parallelism all-reduces the [tokens, hidden] activations twice per layer
(after o_proj and after the MLP's down_proj) plus once for the vocab-parallel
embedding; a ring all-reduce moves 2 (M-1)/M of the buffer through every device's
link in each direction.
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import jax.numpy as jnp

from jaxserve.checkpoints.model_configs import ALIASES, BUILTIN_CONFIGS  # noqa: F401  (one source)
from jaxserve.config import default_max_num_seqs
from jaxserve.engine_args import add_engine_args
from jaxserve.planning.cache_plan import CachePlan, plan_caches
from jaxserve.planning.kv_budget import activation_bytes, kv_budget_bytes
from jaxserve.planning.plan_format import format_plan

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


def load_model_config(model: str):
    """An alias or its repo id (built-in config), a config.json path, a checkpoint
    directory or a repo id in the local Hugging Face cache (config only, no weights)."""
    from jaxserve.checkpoints.model_names import builtin_config, resolve_model
    from models.config import ModelConfig
    config = builtin_config(model)
    if config is not None:
        return ModelConfig.from_hf_dict(config)
    if Path(model).is_file():
        with open(model) as f:
            return ModelConfig.from_hf_dict(json.load(f))
    return ModelConfig.from_pretrained(resolve_model(model, load_format="dummy"))


@dataclass(frozen=True)
class WeightFigures:
    """Parameter count and bytes of one replica's weights on a 1xM mesh."""
    num_params: int
    weight_bytes: int                 # one replica, all devices
    bytes_per_device: int
    replicated_bytes: int             # of bytes_per_device, held by every device


def weight_figures(mc, m: int, dtype: str, weight_quant=None,
                   kv_cache_quantized: bool = False, expert_parallel: bool = False
                   ) -> WeightFigures:
    """From the flax model's parameter shapes and dtypes (jax.eval_shape: nothing
    allocated; quantized kernels in their own dtype, their scales float32, the rest in
    `dtype`; a quantized KV cache adds its float32 scales) and their placement by
    sharding/rules.py."""
    from flax.traverse_util import flatten_dict

    from models.registry import build_model
    from models.weights import abstract_params, param_logical_axes
    from sharding import MODEL, kv_head_repeats, logical_to_mesh, mesh_rules, with_stored_kv_heads

    repeats = kv_head_repeats(mc, m)
    module = build_model(replace(with_stored_kv_heads(mc, m), weight_quant=weight_quant,
                                 kv_cache_quantized=kv_cache_quantized), dtype, "reference")
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
    # The engine's cache plan (planning/cache_plan.py) for this memory; None when the
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

    @property
    def free_after_weights(self) -> int:
        return max(0, (self.hbm_bytes or 0) - self.weight_bytes_per_device)

    @property
    def kv_budget_bytes(self) -> int:
        """What the engine gives the KV cache (and a hybrid's state slots): hbm_utilization
        of what the weights leave, less any activations past the rest (kv_budget); with
        the device memory unknown, what the cache plan took."""
        if self.hbm_bytes is None:
            return self.cache.total_bytes if self.cache else 0
        return kv_budget_bytes(self.free_after_weights, self.hbm_utilization,
                               self.activation_bytes)

    @property
    def reserve_bytes(self) -> int:
        return self.free_after_weights - self.kv_budget_bytes

    @property
    def is_hybrid(self) -> bool:
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
        if self.is_hybrid and self.state_budget_bytes > self.kv_budget_bytes:
            return 0
        return min(seqs, self.max_num_seqs) if self.is_hybrid else seqs

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

    def to_json(self) -> dict:
        """The fields, the cache plan, and the figures derived from them that the printout
        shows (KV capacity, full-length sequences that fit, whether it fits)."""
        c = self.cache
        return {**asdict(self), "kv_budget_bytes": self.kv_budget_bytes,
                "kv_tokens": self.kv_tokens, "max_concurrency": self.max_sequences,
                "state_slots": self.state_slots, "memory_fits": self.memory_fits,
                "fits": self.fits,
                "sliding_pages_per_seq": c.sliding_pages_per_seq if c else 0,
                "sliding_kv_saved_bytes": c.sliding_saved_bytes if c else 0,
                "full_history_kv_tokens": c.full_history_kv_tokens if c else 0}

    def allreduce_seconds(self, nbytes: float) -> float:
        m = self.mesh[1]
        return 0.0 if m == 1 else 2 * (m - 1) / m * nbytes / (self.link_gbps * 1e9)


def make_plan(mc, *, model: str, mesh: str, dtype: str = "auto", kv_cache_dtype: str = "auto",
              quantization: str | None = None,
              max_model_len: int | None = None, max_num_seqs: int = 256,
              max_num_batched_tokens: int | None = None, hbm_bytes: int | None = None,
              hbm_utilization: float | None = None, link_gbps: float = DEFAULT_LINK_GBPS,
              weights: WeightFigures | None = None, platform: str | None = None,
              page_size: int = 16, kv_cache_memory_bytes: int | None = None,
              num_pages: int | None = None, cache: CachePlan | None = None,
              prefix_caching: bool = True, expert_parallel: bool = False) -> Plan:
    """weights: the parameter figures if known; by default from the flax model (which
    needs the model class of mc.architecture). platform "tpu": also check the limits
    of the TPU compiler that the kernels cannot stream around (compiler_limit).
    The cache plan: `cache` when given (a running engine's), else made by the engine's
    rule from num_pages, kv_cache_memory_bytes or hbm_bytes (none of them: unknown).
    hbm_utilization None: the accelerators' default."""
    from jaxserve.config import DEFAULT_HBM_UTILIZATION
    from models.cache_spec import (PagedKVSpec, RecurrentStateSpec, SharedKVSpec,
                                   layer_cache_specs)
    from models.config import SERVING_DTYPES, resolve_weight_quant
    from models.registry import resolve_dtype, resolve_kv_dtype
    from pallas_kernels.ragged_paged_attention import is_quantized
    from sharding import check_model_axis, with_stored_kv_heads
    from sharding.mesh import parse_mesh

    d, m = parse_mesh(mesh)
    check_model_axis(mc, m, expert_parallel)
    if dtype != "auto" and dtype not in SERVING_DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {('auto', *SERVING_DTYPES)}")
    dt = resolve_dtype(dtype, mc)
    kv_dt = resolve_kv_dtype(kv_cache_dtype, dt)
    weight_quant = resolve_weight_quant(quantization, mc.weight_quant)
    stored = with_stored_kv_heads(mc, m)
    kv_heads = stored.num_kv_heads
    w = weights or weight_figures(mc, m, dt.name, weight_quant, is_quantized(kv_dt),
                                  expert_parallel)
    max_model_len = max_model_len or mc.max_position_embeddings
    tokens = max_num_batched_tokens or max(2048, max_num_seqs)
    specs = layer_cache_specs(stored, kv_dtype=kv_dt, conv_state_dtype=dt)
    kv_tok = sum(s.bytes_per_token() for s in specs
                 if isinstance(s, PagedKVSpec) and s.sliding_window is None) // m
    sliding = [s for s in specs if isinstance(s, PagedKVSpec) and s.sliding_window is not None]
    state = sum(s.bytes_per_slot() for s in specs if isinstance(s, RecurrentStateSpec))
    act = activation_bytes(mc, m, tokens, max_num_seqs, dt.itemsize, max_model_len)
    limit = None
    if platform == "tpu":
        from jaxserve.engine.layout import attention_shapes, tpu_kernel_limit_error
        limit = next(filter(None, (tpu_kernel_limit_error(
            mc, stored.layer_num_kv_heads(i), num_tokens=tokens, rows=max_num_seqs,
            max_model_len=max_model_len, page_size=page_size) for i in attention_shapes(stored))),
            None)
    hbm_utilization = hbm_utilization or DEFAULT_HBM_UTILIZATION
    if cache is None and (num_pages or kv_cache_memory_bytes or hbm_bytes):
        budget = None if num_pages else kv_cache_memory_bytes or kv_budget_bytes(
            max(0, hbm_bytes - w.bytes_per_device), hbm_utilization, act)
        cache = plan_caches(specs, model_axis=m, page_size=page_size,
                            max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                            max_num_batched_tokens=tokens, num_pages=num_pages,
                            budget_bytes=budget, prefix_caching=prefix_caching)
    return Plan(
        model=f"{model} ({mc.architecture})", mesh=(d, m), dtype=dt.name,
        kv_dtype=jnp.dtype(kv_dt).name,
        quantization=weight_quant.method if weight_quant else None, num_params=w.num_params, weight_bytes=w.weight_bytes,
        weight_bytes_per_device=w.bytes_per_device, replicated_param_bytes=w.replicated_bytes,
        kv_heads=mc.num_kv_heads, kv_heads_stored=kv_heads, kv_bytes_per_token_per_device=kv_tok,
        global_kv_heads=mc.full_num_kv_heads, global_kv_heads_stored=stored.full_num_kv_heads,
        num_layers=mc.num_layers, full_attention_layers=len(mc.full_attention_layers),
        state_bytes_per_seq=state, state_bytes_per_seq_per_device=state // m,
        state_layout=_state_layout(mc, dt.name), hidden_size=mc.hidden_size,
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=tokens,
        activation_bytes=act, hbm_bytes=hbm_bytes, hbm_utilization=hbm_utilization,
        link_gbps=link_gbps, cache=cache, compiler_limit=limit,
        sliding_attention_layers=len(sliding),
        sliding_kv_bytes_per_token_per_device=sum(s.bytes_per_token() for s in sliding) // m,
        sliding_window=mc.sliding_window if sliding else None,
        kv_shared_layers=sum(isinstance(s, SharedKVSpec) for s in specs),
        expert_parallel=expert_parallel)


def _state_layout(mc, dtype: str) -> str:
    """What a hybrid model's recurrent state is made of, for the printout ("" if none).
    The conv state is in the model dtype, the delta-rule state float32; both are split
    by key-head group over M (sharding.check_model_axis requires M to divide them)."""
    if not mc.is_hybrid:
        return ""
    return (f"{len(mc.linear_attention_layers)} linear-attention layers x (conv "
            f"{mc.linear_conv_kernel_dim - 1} x {mc.linear_conv_dim} {dtype} + delta rule "
            f"{mc.linear_num_value_heads} x {mc.linear_key_head_dim} x "
            f"{mc.linear_value_head_dim} float32)")


def plan_for_engine(info) -> str:
    """The plan of a running engine (its EngineInfo), for the server's start-up log: its
    own cache plan, device memory from the first device's stats (unknown on CPU)."""
    import jax

    cfg = info.config
    stats = jax.devices()[0].memory_stats() or {}
    plan = make_plan(info.model_config, model=cfg.model, mesh=cfg.mesh or "1x1",
                     dtype=info.dtype, kv_cache_dtype=cfg.kv_cache_dtype,
                     quantization=cfg.quantization,
                     max_model_len=info.max_model_len, max_num_seqs=cfg.max_num_seqs,
                     max_num_batched_tokens=cfg.num_batched_tokens, page_size=cfg.page_size,
                     hbm_bytes=stats.get("bytes_limit"), hbm_utilization=cfg.hbm_utilization,
                     cache=info.cache_plan, expert_parallel=cfg.enable_expert_parallel)
    return format_plan(plan)


# The engine flags a plan takes: made from EngineConfig's fields, as the server's are.
PLAN_ENGINE_FLAGS = ("mesh", "hbm_utilization", "max_model_len", "max_num_seqs",
                     "max_num_batched_tokens", "dtype", "kv_cache_dtype", "quantization",
                     "enable_prefix_caching", "enable_expert_parallel")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxserve.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True,
                    help="an alias (" + ", ".join(ALIASES) + ") or its repo id, a checkpoint "
                         "dir, a config.json, or a repo id in the local Hugging Face cache")
    ap.add_argument("--hbm", default=None, help="memory per device, e.g. 80GiB")
    add_engine_args(ap, PLAN_ENGINE_FLAGS)
    ap.add_argument("--interconnect-gbps", type=float, default=DEFAULT_LINK_GBPS,
                    help="link bandwidth per direction per device in GB/s (default: NVLink 4 "
                         "on H100 SXM, 450)")
    ap.add_argument("--target", default=None, help="a TPU (tpu-v5e, tpu-v6e, tpu-v5p): its "
                    "usable HBM per chip; with --compile, the chip to compile for")
    ap.add_argument("--compile", nargs="?", const="default", choices=("default", "all"),
                    default=None, help="compile the engine's warmup programs for --target on "
                    "this host: the smallest and largest forward token bucket and the costliest "
                    "sampler (penalties, largest row bucket), or 'all' of them")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    args = ap.parse_args(argv)
    # EngineConfig's defaults where it resolves None: one device, and the rows of the
    # platform planned for.
    args.mesh = args.mesh or "1x1"
    if args.max_num_seqs is None:
        args.max_num_seqs = default_max_num_seqs("tpu" if args.target else "gpu")
    return args


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = parse_args(ap, argv)
    try:
        if args.target and args.hbm:
            raise ValueError("give --hbm or --target (which sets the HBM), not both")
        if args.compile:
            if not args.target:
                raise ValueError("--compile needs --target (tpu-v5e, tpu-v6e or tpu-v5p)")
            return _compile(args)
        hbm = _target_hbm(args.target) if args.target else \
            parse_bytes(args.hbm) if args.hbm else None
        mc = load_model_config(args.model)
        plan = make_plan(mc, model=args.model, mesh=args.mesh, dtype=args.dtype,
                         kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                         max_model_len=args.max_model_len,
                         max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         prefix_caching=args.enable_prefix_caching,
                         expert_parallel=args.enable_expert_parallel,
                         hbm_bytes=hbm, hbm_utilization=args.hbm_utilization,
                         link_gbps=args.interconnect_gbps,
                         platform="tpu" if args.target else None)
    except ValueError as e:
        ap.exit(2, f"error: {e}\n")
    print(json.dumps(plan.to_json()) if args.json else format_plan(plan))


def _target_hbm(target: str) -> int:
    """What the engine would see as the chip's memory (the runtime keeps the rest)."""
    from sharding.tpu_targets import tpu_target
    return tpu_target(target).usable_hbm_bytes


def _compile(args) -> None:
    """--compile: build the engine for --target, compile, print the report."""
    import sys

    from jaxserve.planning.plan_compile import compile_plan, format_report

    def progress(r) -> None:   # flagship programs take minutes each: say what is done
        state = "compiled" if r.compiled else "FAILED"
        print(f"[plan] {r.name} {r.tokens or r.rows}: {state} in {r.compile_seconds:.1f} s",
              file=sys.stderr, flush=True)

    kw = {k: v for k, v in (("max_model_len", args.max_model_len),
                            ("max_num_batched_tokens", args.max_num_batched_tokens)) if v}
    report = compile_plan(args.model, target=args.target, mesh=args.mesh, select=args.compile,
                          progress=progress, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                          quantization=args.quantization,
                          enable_expert_parallel=args.enable_expert_parallel,
                          max_num_seqs=args.max_num_seqs, hbm_utilization=args.hbm_utilization,
                          **kw)
    print(json.dumps(report.to_json()) if args.json else format_report(report))


if __name__ == "__main__":
    main()
