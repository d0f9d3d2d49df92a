"""`python -m jaxserve.plan --compile`: the engine's programs compiled for a TPU.

    python -m jaxserve.plan --model qwen3.6-27b --mesh 1x8 --target tpu-v6e \\
        --max-model-len 8192 --compile [all|decode] [--decode-rows 1,64,256] [--json]

One replica is built exactly as EngineCore builds it (build/layout.py: dtypes, KV
heads, attention backend for the TPU, the KV page count from the target's HBM and
hbm_utilization; ModelRunner: buckets, shardings, donation), with abstract
parameters and caches (nothing allocated), on a mesh of abstract TPU chips
(sharding/tpu_targets.py). Its warmup programs are then compiled by libtpu's
deviceless XLA:TPU + Mosaic compilers on this CPU host, and each reports the
compiler's per-device memory. A program's own peak leaves out what stays resident
beside it (the sampler does not take the KV cache, nor the forward the lm_head: jit
drops unused arguments), so each also reports the device's peak while it runs:
everything resident (weights, KV pages, state) + its inputs + its non-aliased outputs
+ its temporaries. The engine takes the free memory from the device
after loading the weights; here it is the chip's published HBM less the weights'
bytes per device (a real chip reserves some HBM for the runtime, so a live engine
gets a little fewer pages).

With decode rows (--decode-rows), the decode step of that many rows (the forward at
their token bucket and the greedy sampler at their row bucket) is compiled too and its
HBM traffic accounted op by op (planning/step_bytes.py), beside the roofline bytes:
`decode` in the report, each with step_bytes, roofline_bytes and top_ops.

A checkpoint directory that serves images (issue 42) builds its vision side as the
engine does (build/vision.py): the tower's weights and the encoder cache are resident
beside the caches, the KV budget loses them and the largest encoder call's reserve, and
the encoder programs (one per bucket) are compiled with the rest.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import jax
from jax.sharding import Mesh

from jaxserve.build.cache_plan import CachePlan
from jaxserve.build.drafter_loader import load_drafter
from jaxserve.build.kv_budget import DeviceMemory
from jaxserve.build.layout import (EngineLayout, build_layout_model, engine_layout,
                                   layout_cache_plan, layout_param_shardings)
from jaxserve.build.parts import build_runner, lora_store
from jaxserve.build.vision import VisionFigures, load_vision
from jaxserve.config import EngineConfig
from jaxserve.checkpoints.model_names import load_model_config
from jaxserve.multimodal.front import image_front
from jaxserve.runner.image_encoder import VisionParts
from jaxserve.planning.host_copies import compile_host_copies
from jaxserve.planning.plan import plan_from_config
from jaxserve.planning.hlo_text import Module, parse_module
from jaxserve.planning.step_bytes import decode_step, roofline
from jaxserve.runner.buckets import pick_bucket
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.parallel_compile import compile_all, default_compile_workers
from jaxserve.runner.programs import (DRAFT, ENCODE, FORWARD, GREEDY, PENALTIES, SAMPLE,
                                      Program)
from models.config import ModelConfig
from models.weights import placed_abstract_params
from sharding import bytes_per_device, replica_meshes
from sharding.mesh import parse_mesh
from sharding.tpu_targets import abstract_tpu_mesh, tpu_target

# The error's first lines are enough to tell SMEM from HBM from a lowering bug.
_ERROR_LINES = 4


@dataclass(frozen=True)
class ProgramResult:
    """One compiled program. Byte figures are the compiler's, per device."""
    name: str
    tokens: int | None
    rows: int | None
    compiled: bool
    compile_seconds: float
    argument_bytes: int | None = None
    output_bytes: int | None = None
    temp_bytes: int | None = None
    alias_bytes: int | None = None
    peak_bytes: int | None = None        # argument + output + temp - alias
    device_peak_bytes: int | None = None  # peak + what is resident beside the program
    flops: float | None = None           # cost_analysis: the compiler's estimate
    bytes_accessed: float | None = None
    optimal_seconds: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class CompileReport:
    model: str
    target: str
    mesh: str
    hbm_bytes: int                       # per chip, what XLA:TPU lets a program use
    published_hbm_bytes: int             # per chip, as published
    max_model_len: int
    max_num_seqs: int
    num_pages: int | None                # the engine's page count, null page included
    weight_bytes_per_device: int
    kv_bytes_per_device: int             # the KV pages the engine would allocate
    state_bytes_per_device: int          # hybrid: the recurrent-state slots
    planner_bytes_per_device: int | None  # jaxserve.plan's weights + LoRA + KV + state
    warmup_programs: int                 # how many programs warmup compiles here
    programs: tuple[ProgramResult, ...] = ()
    compile_workers: int = 1             # programs compiled at once (each one's seconds
                                         # are then shared time on this host's cores)
    wall_seconds: float = 0.0            # compiling them all, start to end
    error: str | None = None             # why the engine could not be built
    decode: tuple[dict[str, Any], ...] = ()   # step_bytes.DecodeStep.to_json() per rows
    lora_bytes_per_device: int = 0       # --enable-lora: the adapters' stacks
    # Images (build/vision.py's figures): the tower's weights and the encoder cache,
    # resident on every device, and the largest encoder call's activation reserve.
    vision_weight_bytes_per_device: int = 0
    encoder_cache_bytes_per_device: int = 0
    encoder_activation_bytes: int = 0

    @property
    def encoders_over_reserve(self) -> tuple[ProgramResult, ...]:
        """The compiled encode programs whose own temporaries exceed the reserve the
        engine keeps for the largest encoder call (encoder_activation_bytes): under the
        engine's memory rule the KV cache would take the memory that call needs."""
        return tuple(p for p in self.programs if p.name == "encode" and p.compiled
                     and p.temp_bytes > self.encoder_activation_bytes)

    @property
    def fits(self) -> bool:
        """The engine could start and serve: it was built, every program compiled, the
        device's peak while each runs is within the chip's HBM, and every encoder call's
        temporaries are within the engine's reserve for them."""
        return (self.error is None and bool(self.programs)
                and all(p.compiled and p.device_peak_bytes <= self.hbm_bytes
                        for p in self.programs)
                and not self.encoders_over_reserve)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["fits"] = self.fits
        out["encoders_over_reserve"] = [p.tokens for p in self.encoders_over_reserve]
        return out


def default_selection(programs: list[Program]) -> list[Program]:
    """The smallest and the largest forward token bucket (at the widest page table), the
    costliest sampler (the penalties one) at the largest row bucket, a model drafter's
    program at those two token buckets, and the smallest and largest encoder bucket."""
    forwards = [p for p in programs if p.kind == FORWARD]
    widest = max(p.pages for p in forwards)
    tokens = sorted({p.tokens for p in forwards})
    picked = [p for p in forwards if p.pages == widest and p.tokens in (tokens[0], tokens[-1])]
    samplers = [p for p in programs if p.kind == SAMPLE]
    rows = max(p.rows for p in samplers)
    picked += [p for p in samplers if p.rows == rows and p.mode == PENALTIES]
    # A model drafter's program (speculative decoding), as the forward.
    picked += [p for p in programs if p.kind == DRAFT and p.pages == widest
               and p.tokens in (tokens[0], tokens[-1])]
    encode = sorted((p for p in programs if p.kind == ENCODE), key=lambda p: p.tokens)
    picked += encode[:1] + encode[1:][-1:]
    return picked


def decode_programs(programs: list[Program], rows: int) -> list[Program]:
    """What a decode step of `rows` rows runs: the forward at their token bucket (the
    widest page table) and the greedy sampler at their row bucket."""
    forwards = [p for p in programs if p.kind == FORWARD]
    widest = max(p.pages for p in forwards)
    tokens = pick_bucket(tuple(sorted({p.tokens for p in forwards})), rows)
    greedy = [p for p in programs if p.kind == SAMPLE and p.mode == GREEDY]
    row_bucket = pick_bucket(tuple(sorted({p.rows for p in greedy})), rows)
    return ([p for p in forwards if p.pages == widest and p.tokens == tokens]
            + [p for p in greedy if p.rows == row_bucket])


def _label(p: Program) -> str:
    return f"{p.name}[t={p.tokens}]" if p.tokens is not None else f"{p.name}[r={p.rows}]"


def _resident(runner: ModelRunner) -> list[Any]:
    """What the runner holds throughout: weights, caches, adapter stacks, and with images
    the tower's weights and the encoder cache."""
    enc = runner.encoder
    return [runner.params, runner.kv_caches, runner.lora_stacks] + \
        ([enc.params, enc.cache] if enc is not None else [])


def _input_bytes(runner: ModelRunner, args: tuple) -> int:
    """Per-device bytes of a program's arguments other than the resident ones (_resident):
    batch inputs, the hidden states it reads, an encoder call's pixels."""
    resident = _resident(runner)
    held = {id(x) for x in jax.tree_util.tree_leaves(resident)}
    total = 0
    for arg in args:
        if any(arg is r for r in resident):
            continue
        for x in jax.tree_util.tree_leaves(arg):
            # (the forward's inputs carry the encoder cache it reads: resident)
            if hasattr(x, "shape") and hasattr(x, "dtype") and id(x) not in held:
                sharding = getattr(x, "sharding", None)
                shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
                total += math.prod(shape) * x.dtype.itemsize
    return total


class SerialAfterFailure:
    """libtpu (jax 0.10.2) segfaults when a compile starts in one thread after another
    thread's compile failed (seen with a scanned forward's RESOURCE_EXHAUSTED; 5 of 5
    runs of tests/sharding/test_plan_compile.py's failing case, 0 of 9 with this): once a
    program fails, the ones that start after it compile one at a time."""

    def __init__(self) -> None:
        self._lock: threading.Lock | None = None

    def failed(self) -> None:
        self._lock = self._lock or threading.Lock()

    def turn(self) -> contextlib.AbstractContextManager:
        return self._lock or contextlib.nullcontext()


def compile_program(runner: ModelRunner, program: Program, resident_bytes: int,
                    gate: SerialAfterFailure, texts: dict[str, Module] | None = None
                    ) -> ProgramResult:
    """Lower and compile one program; a failure (e.g. RESOURCE_EXHAUSTED) is reported,
    with the error's first lines, not raised. resident_bytes: per device, what the
    engine holds throughout (weights, KV pages, state). gate: shared by the programs of
    one compile_plan. texts: where to keep the parsed compiled program, by _label."""
    return _compile(lambda: runner.lower(program), program.name, program.tokens, program.rows,
                    _input_bytes(runner, program.args()), resident_bytes, gate,
                    texts, _label(program))


def _compile(lower: Callable[[], Any], name: str, tokens: int | None, rows: int | None,
             inputs: int, resident_bytes: int, gate: SerialAfterFailure,
             texts: dict[str, Module] | None = None, label: str = "") -> ProgramResult:
    """compile_program for any lowering: inputs, per device, what the program takes
    beside the resident arrays."""
    start = time.perf_counter()
    try:
        with gate.turn():
            compiled = lower().compile()
    except Exception as e:   # noqa: BLE001 -- any compiler error is a result here
        gate.failed()
        lines = [ln for ln in str(e).splitlines() if ln.strip()][:_ERROR_LINES]
        return ProgramResult(name, tokens, rows, False, time.perf_counter() - start,
                             error=f"{type(e).__name__}: " + "\n".join(lines))
    seconds = time.perf_counter() - start
    if texts is not None:
        texts[label] = parse_module(compiled.as_text())
    ma = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):   # older jax: one dict per computation
        cost = cost[0] if cost else {}
    arg, out = ma.argument_size_in_bytes, ma.output_size_in_bytes
    temp, alias = ma.temp_size_in_bytes, ma.alias_size_in_bytes
    return ProgramResult(name, tokens, rows, True, seconds,
                         argument_bytes=arg, output_bytes=out, temp_bytes=temp,
                         alias_bytes=alias, peak_bytes=arg + out + temp - alias,
                         # What is resident or an input but no argument of the program
                         # (unused, dropped by jit); the compiler's bytes include layout
                         # padding, hence max(0, ...).
                         device_peak_bytes=arg + out + temp - alias
                         + max(0, resident_bytes + inputs - arg),
                         flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed"),
                         optimal_seconds=cost.get("optimal_seconds"))


@dataclass(frozen=True)
class AbstractEngine:
    """One replica as EngineCore would build it, with nothing allocated."""
    runner: ModelRunner                   # abstract=True
    layout: EngineLayout
    cache_plan: CachePlan
    weight_bytes_per_device: int          # the model's and a model drafter's
    lora_bytes_per_device: int            # --enable-lora: the adapters' stacks
    programs: list[Program]               # runner.warmup_programs()
    vision: VisionFigures | None = None   # when it serves images (build/vision.py)


def build_abstract_engine(config: EngineConfig, mc: ModelConfig, mesh: Mesh,
                          hbm_bytes: int) -> AbstractEngine:
    """mesh: one replica's 1xM mesh of abstract chips. ValueError when the engine would
    refuse to start (e.g. no room for one sequence)."""
    config = config.for_platform(mesh.devices.flat[0].platform)
    layout = engine_layout(config, mc, mesh)
    model = build_layout_model(layout)
    params = placed_abstract_params(model, layout.dtype,
                                    layout_param_shardings(model, mesh, layout))
    # Speculative decoding's model drafter (mtp, draft_model): its weights and KV too.
    drafter = load_drafter(config, layout, mesh, abstract=True)
    weights = bytes_per_device(params) + (bytes_per_device(drafter.params) if drafter else 0)
    # The engine allocates the adapters' stacks before it sizes the caches (parts.py);
    # their bytes as the planner counts them (LoRAStore.bytes_per_device).
    lora = lora_store(config, layout, model)
    stacks = lora.bytes_per_device(layout.model_axis) if lora else 0
    vision, fig = _vision_side(config, mc, layout)
    # A TPU's pool is the chip's usable memory (build/device_pool.py). The tower is held
    # before the caches are sized, as in the engine (build/parts.py).
    plan = layout_cache_plan(config, layout, None,
                             DeviceMemory(hbm_bytes, hbm_bytes, weights + stacks
                                          + (fig.weight_bytes if fig else 0)),
                             drafter_specs=drafter.cache_specs if drafter else (), vision=fig)
    runner = build_runner(config, layout, plan, model=model, params=params, mesh=mesh,
                          drafter=drafter, abstract=True, lora=lora, vision=vision)
    return AbstractEngine(runner, layout, plan, weights, stacks, runner.warmup_programs(),
                          fig)


def _vision_side(config: EngineConfig, mc: ModelConfig, layout: EngineLayout
                 ) -> tuple[VisionParts | None, VisionFigures | None]:
    """The engine's vision side for a checkpoint directory that serves images (a
    built-in config has no tower): its parts (the tower read from the checkpoint; the
    abstract runner keeps only its shapes) and figures."""
    if not os.path.isdir(config.model):
        return None, None
    side = load_vision(image_front(config), layout.dtype, config.num_batched_tokens,
                       mc.hidden_size, mc.image_attention_both_ways)
    return side or (None, None)


def compile_plan(model: str, *, target: str, mesh: str = "1x1",
                 select: str | Callable[[list[Program]], list[Program]] = "default",
                 progress: Callable[[ProgramResult], None] | None = None,
                 workers: int | None = None, decode_rows: tuple[int, ...] = (),
                 decode_context: int | None = None, **engine_kw: Any) -> CompileReport:
    """Build the engine for `target` and compile the selected warmup programs: "default"
    (default_selection), "all", "decode" (only the decode steps'), or a function picking
    from warmup's list, `workers` at a time (None: one, or JAXSERVE_COMPILE_WORKERS when
    set; see below). decode_rows: account the decode step of
    each many rows (module doc), at decode_context tokens per row (None: max_model_len,
    or the whole pages of the rows' equal share of the KV cache). engine_kw: EngineConfig fields
    (max_model_len, max_num_seqs, hbm_utilization, dtype, ...)."""
    # The engine sizes its cache from what the runtime reports (bytes_limit), the HBM
    # less the runtime's share: the compiler's "available HBM".
    hbm = tpu_target(target).usable_hbm_bytes
    _, m = parse_mesh(mesh)
    mc = load_model_config(model)
    # Each of the D replicas compiles the same programs on its own 1xM devices. The
    # default rows are the target's, not this host's (EngineConfig would ask jax here).
    config = EngineConfig(model=model, mesh=f"1x{m}", load_format="dummy",
                          compilation_cache_dir=None, **engine_kw).for_platform("tpu")
    replica = replica_meshes(abstract_tpu_mesh(target, mesh))[0]
    base = CompileReport(model=model, target=target, mesh=mesh, hbm_bytes=hbm,
                         published_hbm_bytes=tpu_target(target).hbm_bytes,
                         max_model_len=config.max_model_len or mc.max_position_embeddings,
                         max_num_seqs=config.max_num_seqs, num_pages=None,
                         weight_bytes_per_device=0, kv_bytes_per_device=0,
                         state_bytes_per_device=0, planner_bytes_per_device=None,
                         warmup_programs=0)
    try:
        eng = build_abstract_engine(config, mc, replica, hbm)
    except ValueError as e:
        return replace(base, error=f"{type(e).__name__}: {e}")
    plan = plan_from_config(config, mc, hbm_bytes=hbm, platform="tpu", label=model)
    chosen = (eng.programs if select == "all" else default_selection(eng.programs)
              if select == "default" else [] if select == "decode" else select(eng.programs))
    steps = {r: decode_programs(eng.programs, r) for r in decode_rows}
    for p in (p for ps in steps.values() for p in ps):
        if p not in chosen:
            chosen.append(p)
    if not chosen:
        raise ValueError("--compile decode needs --decode-rows")
    enc = eng.runner.encoder
    resident = (eng.weight_bytes_per_device + eng.lora_bytes_per_device
                + bytes_per_device(eng.runner.kv_caches)
                + (bytes_per_device([enc.params, enc.cache]) if enc is not None else 0))
    workers = _compile_workers() if workers is None else workers
    start = time.perf_counter()
    gate = SerialAfterFailure()
    texts: dict[str, Module] = {}
    keep = {_label(p) for ps in steps.values() for p in ps}
    results = compile_all(chosen, lambda prog: compile_program(
                              eng.runner, prog, resident, gate,
                              texts if _label(prog) in keep else None),
                          workers=workers,
                          on_done=None if progress is None else lambda _, r, __: progress(r))
    if config.kv_offloading_size:   # the host tier's copies, as the engine would run them
        results = [*results, *compile_host_copies(eng.runner, lambda lower, name, inputs: _compile(
            lower, name, None, None, inputs, resident, gate))]
    wall = time.perf_counter() - start
    v = eng.vision
    by_label = {_label(p): r for p, r in zip(chosen, results)}
    decode = tuple(account_decode(eng, mc, rows, progs, texts, by_label, decode_context)
                   for rows, progs in steps.items())
    return replace(
        base, num_pages=eng.cache_plan.num_pages,
        weight_bytes_per_device=eng.weight_bytes_per_device,
        lora_bytes_per_device=eng.lora_bytes_per_device,
        kv_bytes_per_device=eng.cache_plan.kv_bytes,
        state_bytes_per_device=eng.cache_plan.state_bytes,
        planner_bytes_per_device=(plan.weight_bytes_per_device + plan.lora_bytes_per_device
                                  + plan.cache.total_bytes
                                  + (v.weight_bytes + v.cache_bytes if v else 0)),
        vision_weight_bytes_per_device=v.weight_bytes if v else 0,
        encoder_cache_bytes_per_device=v.cache_bytes if v else 0,
        encoder_activation_bytes=v.activation_bytes if v else 0,
        warmup_programs=len(eng.programs), programs=tuple(results), compile_workers=workers,
        wall_seconds=wall, decode=decode)


def _compile_workers() -> int:
    """One at a time unless JAXSERVE_COMPILE_WORKERS says otherwise: libtpu's deviceless
    compiler crashed (SIGSEGV) twice here with programs compiling at once (stop 49: this
    module's test in a full suite run, and a --decode-rows 1,64 plan)."""
    return default_compile_workers() if os.environ.get("JAXSERVE_COMPILE_WORKERS") else 1


def account_decode(eng: AbstractEngine, mc: ModelConfig, rows: int, progs: list[Program],
                   texts: dict[str, Module], results: dict[str, ProgramResult],
                   context: int | None) -> dict[str, Any]:
    """One decode step's accounted bytes beside its roofline (planning/step_bytes.py)."""
    labels = [_label(p) for p in progs]
    # Default: max_model_len, or as many whole pages as each row's equal share of the
    # cache holds (a part page would make the rows need more pages than there are).
    plan = eng.cache_plan
    context = context or min(eng.layout.max_model_len,
                             plan.kv_tokens // plan.page_size // rows * plan.page_size)
    if any(lb not in texts for lb in labels):
        return {"rows": rows, "context": context, "programs": labels,
                "error": "a program of the step did not compile"}
    params = eng.runner.params
    embed = params.get("embed_tokens", {}).get("embedding") if isinstance(params, dict) \
        else None
    untied = embed is not None and not mc.tie_word_embeddings
    roof = roofline(weight_bytes=eng.weight_bytes_per_device,
                    embedding_bytes=bytes_per_device(embed) if untied else 0,
                    hidden_row_bytes=mc.hidden_size * embed.dtype.itemsize if untied else 0,
                    specs=eng.layout.cache_specs, model_axis=eng.layout.model_axis,
                    rows=rows, context=context)
    compiler = [results[lb].bytes_accessed for lb in labels]
    step = decode_step([(lb, texts[lb]) for lb in labels], roof, rows=rows, context=context,
                       compiler_bytes=sum(compiler) if None not in compiler else None)
    return step.to_json()
