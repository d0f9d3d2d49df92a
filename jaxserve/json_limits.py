"""The shape of untrusted JSON text, measured before anything parses it.

Python's json parser, pydantic and every walker of the result recurse once per nesting
level, and their cost grows with the number of values, not bytes: a 30 MB list of small
ints is millions of objects. So the server measures a body's depth, values and object
fields on the raw bytes as they arrive (JsonShape) and refuses an outsized one before
parsing; JSON text inside a string (a tool call's arguments) goes through `loads`, which
checks its depth first.

The scan runs bytes methods (and numpy for the depth) over each piece: no Python loop
per character.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

# Nesting levels any JSON this server reads may have. Real requests nest a few levels (a
# tool's parameter schema ten or twenty); Python's recursion limit (1000) is far away.
MAX_JSON_DEPTH = 64

_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
_OPENING = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")   # +1 / -1 as int8
_SLICE = 1 << 20   # brackets per numpy pass (bounds its temporary arrays)
_PIECE = 1 << 16   # bytes json_depth feeds at a time (faster than one big piece)


class JsonShape:
    """Depth, values (array elements and object members, counted as commas plus opening
    brackets) and object fields of a JSON text fed in pieces; what lies inside strings
    does not count. Text that is not JSON gets some count; the parser refuses it later."""

    def __init__(self) -> None:
        self.depth = 0          # levels open at the end of what was fed
        self.max_depth = 0
        self.values = 0
        self.fields = 0
        self._in_string = False
        self._carry = b""       # a backslash that escapes the next piece's first byte

    def feed(self, data: bytes) -> None:
        data = self._carry + data
        # A run of backslashes at the end: an odd one escapes what comes next.
        run = len(data) - len(data.rstrip(b"\\"))
        cut = len(data) - run % 2
        data, self._carry = data[:cut], data[cut:]
        # Only the escapes \\ and \" could hide a quote: blank them. Then the quotes
        # split the text into stretches outside and inside strings, alternately.
        parts = data.replace(b"\\\\", b"__").replace(b'\\"', b"__").split(b'"')
        outside = b"".join(parts[1 if self._in_string else 0::2])
        self._in_string ^= (len(parts) - 1) % 2 == 1
        self.values += outside.count(b",") + outside.count(b"[") + outside.count(b"{")
        self.fields += outside.count(b":")
        steps = outside.translate(None, _NOT_BRACKETS).translate(_OPENING)
        for start in range(0, len(steps), _SLICE):
            levels = np.cumsum(np.frombuffer(steps[start:start + _SLICE], np.int8),
                               dtype=np.int64) + self.depth
            self.max_depth = max(self.max_depth, int(levels.max()))
            self.depth = int(levels[-1])


def json_depth(text: str | bytes) -> int:
    """The deepest nesting of brackets outside strings in `text`."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    shape = JsonShape()
    for start in range(0, len(data), _PIECE):
        shape.feed(data[start:start + _PIECE])
    return shape.max_depth


def check_depth(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> None:
    """A ValueError naming the bound when `text` nests deeper than max_depth."""
    brackets = sum(text.count(b) for b in (("[", "{") if isinstance(text, str) else (b"[", b"{")))
    if brackets > max_depth:   # (fewer brackets cannot nest deeper: no scan)
        depth = json_depth(text)
        if depth > max_depth:
            raise ValueError(f"JSON nested {depth} levels deep; at most {max_depth} "
                             f"(MAX_JSON_DEPTH)")


def loads(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads, refusing text nested deeper than max_depth (a ValueError, as for any
    invalid JSON) before the recursive parser could overflow the stack."""
    check_depth(text, max_depth)
    return json.loads(text)
