"""The decode step's HBM traffic, accounted op by op from the compiled TPU programs.

XLA's cost analysis (`bytes accessed`) is an upper bound that says little about a decode
step: it charges an in-place scatter for the whole cache it writes into, a kernel's
`pl.CostEstimate` is a bound from static shapes, and a loop's body is counted once.
Here every instruction the step runs is walked (loop bodies times their trip count,
the costlier branch of a conditional) and charged the bytes that really cross HBM:

- an array outside HBM (a TPU layout's memory space S(n), VMEM) is never charged;
- a fusion reads each HBM operand whole, except one it only slices (a layer's weights
  out of the stacked [L, ...] array: the slices) or updates in place (a cache: nothing
  read), and writes each HBM output whole, except one updated in place (the update);
- a prefetch (copy-start) moves its array once, a copy reads and writes it;
- the ragged paged attention kernel reads the KV pages of the step's rows at their
  context (a sliding layer's window), plus its other HBM operands and outputs;
- the gated delta decode kernel moves its CostEstimate's bytes for the step's rows
  (each row's state read and written once; the estimate is for the row bucket);
- another Pallas kernel moves its CostEstimate's bytes, in the share of its operands'
  and outputs that are in HBM (XLA:TPU's ragged dot takes all of them from VMEM, moved
  there by the ops before it: nothing); any other op its HBM operands and outputs;
- a loop whose trip count the program reads from its inputs (a hybrid's prefill-chunk
  loop, the state-snapshot copies: none of them runs for decode rows) is not counted,
  but listed with its bytes per trip (`dynamic_loops`).

The roofline is what a decode step cannot avoid moving: every weight once (an untied
input embedding: the rows' vectors only), the KV of each row's context (a sliding layer:
its window) and of the new token, and a hybrid's recurrent state read and written.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from jaxserve.planning.hlo_text import Array, Computation, Instr, Module
from models.cache_spec import PagedKVSpec, RecurrentStateSpec
from pallas_kernels.ragged_paged_attention.cost import pages_read

TOP_SHARE = 0.01   # top_ops: every op above this share of the step
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "copy-done", "opt-barrier", "add-dependency",
         "domain", "all-reduce-done", "all-gather-done", "collective-permute-done",
         "async-done", "call-done", "send-done", "recv-done"}
_SLICING = ("dynamic-slice", "slice", "gather")
_IN_PLACE = ("dynamic-update-slice", "scatter")


@dataclass(frozen=True)
class OpBytes:
    program: str
    name: str
    opcode: str
    op_name: str         # the JAX source path (trimmed)
    bytes: int           # per run
    runs: int            # times the step runs it (loop trip counts)
    how: str = ""

    @property
    def total(self) -> int:
        return self.bytes * self.runs


def _arrays_bytes(arrays: list[Array]) -> int:
    return sum(a.nbytes for a in arrays if a.in_hbm)


def _short(op_name: str) -> str:
    parts = [p for p in op_name.split("/") if p and not p.startswith(("jit(", "closed_call",
                                                                       "while", "body"))]
    return "/".join(parts[-4:]) or op_name


class _Walk:
    def __init__(self, module: Module, program: str, rows: int, context: int) -> None:
        self.m, self.program, self.rows, self.context = module, program, rows, context
        self.ops: list[OpBytes] = []
        self.dynamic_loops: list[dict[str, Any]] = []

    # ---- control flow -------------------------------------------------------------
    def computation(self, comp: Computation, runs: int) -> None:
        for ins in comp.instrs:
            self.instr(comp, ins, runs)

    def instr(self, comp: Computation, ins: Instr, runs: int) -> None:
        op = ins.opcode
        if op in _FREE:
            return
        if op == "while":
            trips = trip_count(self.m, comp, ins)
            if trips is not None:
                self.computation(self.m[ins.called["body"]], runs * trips)
                return
            sub = _Walk(self.m, self.program, self.rows, self.context)
            sub.computation(self.m[ins.called["body"]], 1)
            self.dynamic_loops.append({"program": self.program, "name": ins.name,
                                       "op_name": _describe(comp, ins),
                                       "bytes_per_trip": sum(o.total for o in sub.ops)})
        elif op == "conditional":
            best: list[OpBytes] = []
            for branch in ins.branches or [ins.called[k] for k in ("true_computation",
                                                                  "false_computation")
                                           if k in ins.called]:
                sub = _Walk(self.m, self.program, self.rows, self.context)
                sub.computation(self.m[branch], runs)
                if sum(o.total for o in sub.ops) >= sum(o.total for o in best):
                    best = sub.ops
                self.dynamic_loops += sub.dynamic_loops
            self.ops += best
        elif op in ("call", "async-start", "call-start"):
            for called in ins.called.values():
                self.computation(self.m[called], runs)
        else:
            moved, how = self.bytes_of(comp, ins)
            if moved:
                self.ops.append(OpBytes(self.program, ins.name, op, _describe(comp, ins),
                                        moved, runs, how))

    # ---- one op ---------------------------------------------------------------------
    def operand_arrays(self, comp: Computation, ins: Instr) -> list[list[Array]]:
        return [comp.by_name[o].shape if o in comp.by_name else [] for o in ins.operands]

    def bytes_of(self, comp: Computation, ins: Instr) -> tuple[int, str]:
        op, out = ins.opcode, _arrays_bytes(ins.shape)
        operands = self.operand_arrays(comp, ins)
        if op == "copy-start":   # (dest, src, context): the array moves once
            src = operands[0][0] if operands and operands[0] else None
            return ((src.nbytes if src and src.in_hbm else 0)
                    + (ins.shape[0].nbytes if ins.shape and ins.shape[0].in_hbm else 0),
                    "prefetch")
        if op == "fusion":
            return self.fusion(comp, ins, operands)
        if op == "custom-call":
            return self.custom_call(ins, operands)
        if op == "dynamic-update-slice":   # in place: the update is read and written
            update = operands[1]
            return _arrays_bytes(update) + (sum(a.nbytes for a in update) if ins.shape
                                            and ins.shape[0].in_hbm else 0), "in place"
        if op in _SLICING:
            src_hbm = bool(operands and operands[0] and operands[0][0].in_hbm)
            size = sum(a.nbytes for a in ins.shape)
            return (size if src_hbm else 0) + out, "slice"
        if op == "scatter":
            updates = [a for arrs in operands[2:] for a in arrs]
            return _arrays_bytes(updates) + (sum(a.nbytes for a in updates)
                                             if ins.shape[0].in_hbm else 0), "in place"
        return sum(_arrays_bytes(a) for a in operands) + out, ""

    def fusion(self, comp: Computation, ins: Instr, operands: list[list[Array]]
               ) -> tuple[int, str]:
        fused = self.m[ins.called["calls"]]
        read = 0
        for i, arrays in enumerate(operands):
            full = _arrays_bytes(arrays)
            if full and i in fused.params:
                read += _param_read(self.m, fused, fused.params[i], full)
        root = fused.root
        outs = root.operands if root.opcode == "tuple" else [root.name]
        write = 0
        for arr, name in zip(ins.shape, outs):
            if not arr.in_hbm:
                continue
            producer = _through_bitcasts(fused, name)
            target = _through_bitcasts(fused, producer.operands[0]) if producer.operands \
                else None
            if producer.opcode in _IN_PLACE and target is not None \
                    and target.opcode == "parameter":
                updates = producer.operands[1:2] if producer.opcode == "dynamic-update-slice" \
                    else producer.operands[2:]
                write += sum(a.nbytes for u in updates for a in fused.by_name[u].shape)
            else:
                write += arr.nbytes
        return read + write, ""

    def custom_call(self, ins: Instr, operands: list[list[Array]]) -> tuple[int, str]:
        if ins.custom_call_target != "tpu_custom_call":
            if ins.custom_call_target == "AllocateBuffer":
                return 0, ""
            return sum(_arrays_bytes(a) for a in operands) + _arrays_bytes(ins.shape), ""
        meta = ins.kernel_metadata
        kernel = meta.get("jaxserve_kernel")
        if kernel == "ragged_paged_attention":
            flat = [a for arrs in operands for a in arrs]
            # the cache: the largest [pages, 2K, S, H] operand in HBM
            cache = max((a for a in flat if a.in_hbm and len(a.dims) == 4),
                        key=lambda a: a.nbytes)
            page_size, page_bytes = cache.dims[2], cache.nbytes // cache.dims[0]
            window = int(meta.get("sliding_window") or 0) or None
            pages = pages_read(num_tokens=self.rows, num_rows=self.rows,
                               pages_per_req=-(-self.context // page_size),
                               page_size=page_size, num_pages=cache.dims[0],
                               sliding_window=window)
            rest = sum(a.nbytes for a in flat if a.in_hbm and a is not cache)
            return (pages * page_bytes + rest + _arrays_bytes(ins.shape),
                    f"KV pages of {self.rows} rows at context {self.context}"
                    + (f", window {window}" if window else ""))
        if ins.cost_bytes is not None:
            if kernel == "gated_delta_decode":
                bucket = int(meta.get("rows") or self.rows)
                return (ins.cost_bytes * min(self.rows, bucket) // bucket,
                        f"CostEstimate for {min(self.rows, bucket)} of {bucket} rows")
            # The estimate counts the kernel's arrays wherever XLA placed them; those it
            # put in VMEM (XLA:TPU's ragged dot, whose every array is) were moved by the
            # op that put them there, charged on its own.
            arrays = [a for arrs in operands for a in arrs] + ins.shape
            everything, hbm = sum(a.nbytes for a in arrays), _arrays_bytes(arrays)
            if hbm < everything:
                return ins.cost_bytes * hbm // everything, "CostEstimate, HBM share"
            return ins.cost_bytes, "CostEstimate"
        return sum(_arrays_bytes(a) for a in operands) + _arrays_bytes(ins.shape), ""


def _describe(comp: Computation, ins: Instr) -> str:
    """The op's JAX source path, else its first operand's (a prefetch of a parameter),
    else the array it moves."""
    for x in (ins, *(comp.by_name.get(o) for o in ins.operands[:1])):
        if x is not None and x.op_name:
            return _short(x.op_name)
    arrays = ins.shape[:1] or []
    return ", ".join(f"{a.dtype}[{','.join(map(str, a.dims))}]" for a in arrays)


def _through_bitcasts(comp: Computation, name: str) -> Instr:
    ins = comp.by_name[name]
    while ins.opcode == "bitcast" and ins.operands:
        ins = comp.by_name[ins.operands[0]]
    return ins


# Ops through which a fused value is only re-indexed or converted: inside a fusion each is
# computed where its user needs it, so a slice after them still reads only the slice.
_PASS = ("bitcast", "copy", "convert", "reshape", "transpose", "bitcast-convert")


def _param_read(module: Module, comp: Computation, param: Instr, full: int) -> int:
    """Bytes of a fusion's parameter read from memory: the slices when it is only sliced
    (through re-indexing ops and nested fusions), nothing where it is only updated in
    place, else all of it."""
    itemsize = param.shape[0].nbytes / max(1, math.prod(param.shape[0].dims))
    got = _reads(module, comp, param, itemsize)
    return full if got is None or got[1] else min(got[0], full)


def _reads(module: Module, comp: Computation, value: Instr, itemsize: float
           ) -> tuple[int, bool] | None:
    """(bytes of `value` read by slices, whether it also flows out of `comp` through the
    root), or None when some user reads it whole."""
    total, escapes, frontier, root = 0, False, [value], comp.root
    while frontier:
        x = frontier.pop()
        if x is root or (root.opcode == "tuple" and x.name in root.operands):
            escapes = True
        for user in comp.users(x.name):
            if user.opcode in _PASS and len(user.operands) == 1:
                frontier.append(user)
            elif user.opcode in _SLICING and user.operands[0] == x.name:
                total += int(math.prod(user.shape[0].dims) * itemsize)
            elif user.opcode in _IN_PLACE and user.operands[0] == x.name:
                continue
            elif user.opcode == "fusion" and "calls" in user.called:
                nested = module[user.called["calls"]]
                for j, name in enumerate(user.operands):
                    if name != x.name or j not in nested.params:
                        continue
                    got = _reads(module, nested, nested.params[j], itemsize)
                    if got is None:
                        return None
                    total += got[0]
                    if got[1]:              # handed on: follow the nested fusion's users
                        frontier.append(user)
            else:
                return None
    return total, escapes


def _scalar_constant(comp: Computation, name: str) -> int | None:
    ins = comp.by_name.get(name)
    while ins is not None and ins.opcode in ("copy", "bitcast", "convert") and ins.operands:
        ins = comp.by_name.get(ins.operands[0])
    if ins is None or ins.opcode != "constant" or ins.shape and ins.shape[0].dims:
        return None
    m = re.fullmatch(r"-?\d+", ins.args.strip())
    return int(m.group(0)) if m else None


def trip_count(module: Module, comp: Computation, w: Instr) -> int | None:
    """A while loop's trips: XLA's known_trip_count, else read from a counter loop
    (condition `i < N` on a tuple element that starts at a constant)."""
    if w.trip_count is not None:
        return w.trip_count
    cond = module[w.called["condition"]]
    root = cond.root
    direction = re.search(r"direction=(\w+)", root.attrs)
    if root.opcode != "compare" or not direction or len(root.operands) != 2:
        return None
    a, b = (cond.by_name[o] for o in root.operands)
    d = direction.group(1)
    counter, limit = (a, b) if d in ("LT", "LE") else (b, a) if d in ("GT", "GE") else (a, b)
    n = _scalar_constant(cond, limit.name)
    index = re.search(r"index=(\d+)", counter.attrs)
    if n is None or counter.opcode != "get-tuple-element" or not index:
        return None
    init = comp.by_name.get(w.operands[0])
    if init is None or init.opcode != "tuple":
        return None
    start = _scalar_constant(comp, init.operands[int(index.group(1))])
    if start is None:
        return None
    return max(0, n - start + (1 if d in ("LE", "GE") else 0))


@dataclass(frozen=True)
class Roofline:
    weight_bytes: int     # every weight once (an untied embedding: the rows' vectors)
    kv_read_bytes: int    # each row's context (a sliding layer: its window)
    kv_write_bytes: int   # the new token's K and V
    state_bytes: int      # a hybrid's recurrent state, read and written

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.state_bytes


def roofline(*, weight_bytes: int, embedding_bytes: int, hidden_row_bytes: int,
             specs: tuple[Any, ...], model_axis: int, rows: int, context: int) -> Roofline:
    """Per device. embedding_bytes: an untied input embedding's (0 when tied: the
    lm_head reads the table whole); hidden_row_bytes: one row of it."""
    kv_read = kv_write = state = 0
    for s in specs:
        if isinstance(s, PagedKVSpec):
            seen = min(context, s.sliding_window) if s.sliding_window else context
            kv_read += rows * seen * s.bytes_per_token() // model_axis
            kv_write += rows * s.bytes_per_token() // model_axis
        elif isinstance(s, RecurrentStateSpec):
            state += 2 * rows * s.bytes_per_slot() // model_axis
    weights = weight_bytes - embedding_bytes + (rows * hidden_row_bytes if embedding_bytes else 0)
    return Roofline(weights, kv_read, kv_write, state)


@dataclass(frozen=True)
class DecodeStep:
    rows: int
    context: int
    programs: tuple[str, ...]        # what the step runs: "forward[t=16]", "sample[...]"
    step_bytes: int
    roofline_bytes: int
    roofline: dict[str, int]
    top_ops: tuple[dict[str, Any], ...]
    compiler_bytes_accessed: float | None = None   # XLA's cost analysis, for comparison
    dynamic_loops: tuple[dict[str, Any], ...] = ()  # not run by decode rows (module doc)

    @property
    def ratio(self) -> float:
        return self.step_bytes / self.roofline_bytes if self.roofline_bytes else math.inf

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


def account(programs: list[tuple[str, Module]], *, rows: int, context: int) -> tuple[
        list[OpBytes], list[dict[str, Any]]]:
    """Every op the step's programs run, with its bytes, and the loops whose trip count
    the program reads from its inputs (not counted: module doc)."""
    ops: list[OpBytes] = []
    loops: list[dict[str, Any]] = []
    for label, module in programs:
        walk = _Walk(module, label, rows, context)
        walk.computation(module[module.entry], 1)
        ops += walk.ops
        loops += walk.dynamic_loops
    return ops, loops


def decode_step(programs: list[tuple[str, Module]], roof: Roofline, *, rows: int,
                context: int, compiler_bytes: float | None = None) -> DecodeStep:
    ops, loops = account(programs, rows=rows, context=context)
    total = sum(o.total for o in ops)
    top = sorted((o for o in ops if o.total > TOP_SHARE * total), key=lambda o: -o.total)
    return DecodeStep(rows, context, tuple(p for p, _ in programs), total, roof.total,
                      asdict(roof), tuple({**asdict(o), "total": o.total,
                                           "share": round(o.total / total, 4)} for o in top),
                      compiler_bytes, tuple(loops))
