"""json_limits measures raw JSON as its parse would see it: depth, values and fields
outside strings (escapes included), the same whatever pieces the bytes arrive in."""
from __future__ import annotations

import json
import random

import pytest

from jaxserve.json_limits import MAX_JSON_DEPTH, JsonShape, json_depth, loads


def measured(value) -> tuple[int, int, int]:
    """(depth, values, fields) of a parsed value: what the scan must find in its text."""
    if isinstance(value, dict):
        inner = [measured(v) for v in value.values()]
        return (1 + max((d for d, _, _ in inner), default=0),
                len(value) + sum(v for _, v, _ in inner), len(value) + sum(f for *_, f in inner))
    if isinstance(value, list):
        inner = [measured(v) for v in value]
        return (1 + max((d for d, _, _ in inner), default=0),
                len(value) + sum(v for _, v, _ in inner), sum(f for *_, f in inner))
    return 0, 0, 0


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 6 else 3)
    if kind == 0:
        return rng.randrange(-5, 1000)
    if kind == 1:   # strings full of what would be structure outside them
        return "".join(rng.choice('ab[]{},:"\\\n') for _ in range(rng.randrange(8)))
    if kind == 2:
        return rng.choice([None, True, 1.5])
    if kind in (3, 4):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(1, 5))]
    return {"k" * rng.randrange(3) + '"]\\' * rng.randrange(2) + str(i):
            random_value(rng, depth + 1) for i in range(rng.randrange(1, 4))}


def test_the_scan_counts_what_the_parser_sees_in_any_pieces():
    rng = random.Random(0)
    for _ in range(300):
        value = {"v": random_value(rng)}
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        depth, values, fields = measured(value)
        shape = JsonShape()
        at = 0
        while at < len(text):      # pieces of 1 to 7 bytes: escapes split across them
            step = rng.randrange(1, 8)
            shape.feed(text[at:at + step])
            at += step
        # (an empty container counts one value: commas plus opening brackets)
        empties = text.count(b"[]") + text.count(b"{}")
        assert (shape.max_depth, shape.fields, shape.depth) == (depth, fields, 0), text
        assert values <= shape.values <= values + empties, text


def test_loads_refuses_deep_text_before_parsing_and_takes_the_rest():
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValueError, match=f"100000 levels deep; at most {MAX_JSON_DEPTH}"):
        loads(deep)
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert json_depth(at_limit) == MAX_JSON_DEPTH and loads(at_limit)
    # brackets inside a string are text, however many
    assert loads(json.dumps({"a": "[" * 10_000})) == {"a": "[" * 10_000}
    with pytest.raises(ValueError):
        loads("{not json")
