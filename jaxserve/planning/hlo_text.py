"""A compiled XLA program's text (`compiled.as_text()`), parsed as far as the step-bytes
accounting needs: computations, their instructions in order, each with its shape
(arrays with dtype, dims and memory space), opcode, operands, the computations it calls
and the attributes read later (trip counts, kernel metadata, cost estimates).

Only what XLA prints is read; nothing here knows a model. A TPU program marks arrays
outside HBM with a memory space in the layout (`{...S(1)}`: VMEM); no mark is HBM.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

HBM = 0
_ITEM_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16,
              "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64,
              "c64": 64, "c128": 128}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_START = re.compile(r"^\s+(ROOT\s+)?%([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s")
_CALLED = re.compile(r"\b(calls|to_apply|condition|body|true_computation|false_computation)"
                     r"=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_REF = re.compile(r"%([\w.\-]+)")


@dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]
    memory_space: int = HBM

    @property
    def nbytes(self) -> int:
        bits = _ITEM_BITS.get(self.dtype)
        if bits is None:
            bits = 8 if self.dtype.startswith("f8") else 0   # f8e4m3fn, ...; token: 0
        return math.prod(self.dims) * bits // 8

    @property
    def in_hbm(self) -> bool:
        return self.memory_space == HBM


@dataclass
class Instr:
    name: str
    shape: list[Array]            # the arrays of its result (a tuple's, flattened)
    opcode: str
    operands: list[str]
    attrs: str                    # everything after the operand list
    is_root: bool = False
    called: dict[str, str] = field(default_factory=dict)   # calls= / body= / ... -> name
    branches: list[str] = field(default_factory=list)
    args: str = ""                # the text between the parentheses (a constant's value)

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    @property
    def trip_count(self) -> int | None:
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', self.attrs)
        return int(m.group(1)) if m else None

    @property
    def custom_call_target(self) -> str | None:
        m = re.search(r'custom_call_target="([^"]*)"', self.attrs)
        return m.group(1) if m else None

    @property
    def kernel_metadata(self) -> dict[str, str]:
        """A Pallas kernel's `metadata=` (frontend attribute kernel_metadata)."""
        m = re.search(r"kernel_metadata=(\{[^{}]*\})", self.attrs)
        if not m:
            return {}
        try:
            return json.loads(m.group(1))
        except ValueError:
            return {}

    @property
    def cost_bytes(self) -> int | None:
        """A Pallas kernel's CostEstimate bytes_accessed."""
        m = re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"', self.attrs)
        return int(m.group(1)) if m else None


@dataclass
class Computation:
    name: str
    instrs: list[Instr] = field(default_factory=list)
    by_name: dict[str, Instr] = field(default_factory=dict)
    params: dict[int, Instr] = field(default_factory=dict)

    @property
    def root(self) -> Instr:
        return next(i for i in self.instrs if i.is_root)

    def users(self, name: str) -> list[Instr]:
        return [i for i in self.instrs if name in i.operands]


@dataclass
class Module:
    computations: dict[str, Computation]
    entry: str

    def __getitem__(self, name: str) -> Computation:
        return self.computations[name]


def parse_arrays(shape: str) -> list[Array]:
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append(Array(dtype, tuple(int(d) for d in dims.split(",") if d),
                         int(space.group(1)) if space else HBM))
    return out


def _balanced(s: str, start: int) -> int:
    """The index just past the bracket group opening at s[start]."""
    depth = 0
    for i in range(start, len(s)):
        if s[i] in "([{":
            depth += 1
        elif s[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(s)


def parse_instr(line: str) -> Instr | None:
    m = _START.match(line)
    if not m:
        return None
    rest = line[m.end():]
    end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = _balanced(rest, op.end() - 1)
    args = rest[op.end():close - 1]
    attrs = rest[close:]
    called = {k: v for k, v in _CALLED.findall(attrs)}
    branches = [b for group in _BRANCHES.findall(attrs) for b in _REF.findall(group)]
    return Instr(m.group(2), parse_arrays(shape), op.group(1), _REF.findall(args), attrs,
                 bool(m.group(1)), called, branches, args)


def parse_module(text: str) -> Module:
    comps: dict[str, Computation] = {}
    entry, comp, pending = "", None, ""

    def flush() -> None:
        nonlocal pending
        if comp is not None and pending:
            ins = parse_instr(pending)
            if ins is not None:
                comp.instrs.append(ins)
                comp.by_name[ins.name] = ins
                if ins.opcode == "parameter":
                    num = re.search(r"\bparameter\((\d+)\)", pending)
                    comp.params[int(num.group(1))] = ins
        pending = ""

    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            flush()
            comp = Computation(header.group(2))
            comps[comp.name] = comp
            if header.group(1):
                entry = comp.name
        elif line.rstrip() == "}":
            flush()
            comp = None
        elif _START.match(line):
            flush()
            pending = line
        elif pending:
            pending += line.strip()   # a multi-line attribute (a kernel's metadata)
    flush()
    return Module(comps, entry)
