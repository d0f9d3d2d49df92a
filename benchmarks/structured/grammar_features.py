"""What each grammar backend can do, checked rather than read from its documentation: a
feature counts only if the backend compiles it, accepts a valid example *and* rejects an
invalid one (a keyword silently ignored would pass a compile-only check). Also the error
text a user gets for an invalid input, and the tables of both."""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks.structured.grammar_adapters import Backend, CompileError
from benchmarks.structured.grammar_fixtures import ARITH_GBNF, ARITH_LARK, CHOICES, Grammar, grammar_kinds
from benchmarks.structured.grammar_fixtures import schema_grammar as _js
from benchmarks.shared.results_io import markdown_table

_OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
           "required": ["a", "b"], "additionalProperties": False}
_TREE = {"$defs": {"node": {"type": "object",
                            "properties": {"v": {"type": "integer"},
                                           "kids": {"type": "array",
                                                    "items": {"$ref": "#/$defs/node"}}},
                            "required": ["v", "kids"], "additionalProperties": False}},
         "$ref": "#/$defs/node"}

# (feature, grammar, a valid output, an invalid output)
FEATURE_PROBES: list[tuple[str, Grammar, str, str]] = [
    ("pattern", _js({"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"}),
     '"abc-12"', '"abc-1x"'),
    ("format: date-time", _js({"type": "string", "format": "date-time"}),
     '"2024-05-17T10:20:30Z"', '"yesterday"'),
    ("format: date", _js({"type": "string", "format": "date"}),
     '"2024-05-17"', '"17/05/2024"'),
    ("format: email", _js({"type": "string", "format": "email"}),
     '"ada@example.com"', '"not an email"'),
    ("format: uuid", _js({"type": "string", "format": "uuid"}),
     '"123e4567-e89b-12d3-a456-426614174000"', '"123e4567"'),
    ("minLength / maxLength", _js({"type": "string", "minLength": 2, "maxLength": 4}),
     '"abc"', '"abcdef"'),
    ("minimum / maximum", _js({"type": "integer", "minimum": 1, "maximum": 12}), "7", "13"),
    ("exclusiveMinimum", _js({"type": "number", "exclusiveMinimum": 0}), "0.5", "-1"),
    ("multipleOf", _js({"type": "integer", "multipleOf": 5}), "15", "7"),
    ("minItems / maxItems", _js({"type": "array", "items": {"type": "integer"},
                                 "minItems": 2, "maxItems": 3}), "[1,2]", "[1]"),
    ("uniqueItems", _js({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
     "[1,2]", "[1,1]"),
    ("prefixItems", _js({"type": "array", "items": False,
                         "prefixItems": [{"type": "integer"}, {"type": "string"}]}),
     '[1,"a"]', '["a",1]'),
    ("enum", _js({"enum": ["red", "green", 3]}), '"green"', '"blue"'),
    ("const", _js({"const": "fixed"}), '"fixed"', '"other"'),
    ("anyOf", _js({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}),
     '"ab"', "true"),
    ("oneOf", _js({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}), "true", '"x"'),
    ("allOf", _js({"allOf": [{"type": "integer", "minimum": 0},
                             {"type": "integer", "maximum": 10}]}), "5", "11"),
    ("not", _js({"not": {"type": "string"}}), "1", '"a"'),
    ("$ref / $defs (recursive)", _js(_TREE), '{"v":1,"kids":[{"v":2,"kids":[]}]}',
     '{"v":1,"kids":[{"v":2}]}'),
    ("required", _js(_OBJ_AB), '{"a":1,"b":2}', '{"a":1}'),
    ("additionalProperties: false", _js(_OBJ_AB), '{"a":1,"b":2}', '{"a":1,"b":2,"c":3}'),
    ("properties in any order", _js(_OBJ_AB), '{"b":2,"a":1}', '{"b":2}'),
    ("type list (nullable)", _js({"type": ["string", "null"]}), "null", "1"),
    ("whitespace / indentation", _js(_OBJ_AB), '{\n  "a": 1,\n  "b": 2\n}', '{"a":1;"b":2}'),
    ("json_object", Grammar("json_object", ""), '{"any":[1,{"x":null}]}', '{"a":}'),
    ("regex", Grammar("regex", r"[a-z]+@[a-z]+\.com"), "bob@example.com", "bob@example.org"),
    ("choice", Grammar("choice", json.dumps(CHOICES)), "neutral", "angry"),
    ("Lark grammar", Grammar("lark", ARITH_LARK), "(1+2)*3", "(1+"),
    ("GBNF / EBNF grammar", Grammar("gbnf", ARITH_GBNF), "(1+2)*3", "(1+"),
]

# (what, grammar): each must be refused; the error text is recorded
INVALID_INPUTS: list[tuple[str, Grammar]] = [
    ("schema is not JSON", Grammar("json_schema", '{"type": "object",')),
    ("unknown type", _js({"type": "strng"})),
    ("dangling $ref", _js({"$ref": "#/$defs/missing"})),
    ("minimum > maximum", _js({"type": "integer", "minimum": 5, "maximum": 1})),
    ("unclosed regex class", Grammar("regex", "[a-z")),
    ("Lark: undefined rule", Grammar("lark", "start: foo\n")),
    ("GBNF: undefined rule", Grammar("gbnf", "root ::= foo\n")),
]

_TOOL = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
         "additionalProperties": False}


def _one_line(x: Any, n: int | None = None) -> str:
    return " ".join(str(x).split())[:n]


def _accepts(backend: Backend, matcher: Any, text: str) -> bool:
    """Whether `matcher` takes the tokens of `text` and then EOS."""
    ids = backend.hf.encode(text, add_special_tokens=False)
    return all(backend.consume(matcher, t) for t in ids + [backend.eos])


def _probe(backend: Backend, make: Callable[[], Any], valid: str, invalid: str) -> str:
    try:
        m1 = make()
        m2 = make()
    except CompileError as e:
        return "error: " + _one_line(e, 160)
    ok_valid, ok_invalid = _accepts(backend, m1, valid), _accepts(backend, m2, invalid)
    if ok_valid and not ok_invalid:
        return "yes"
    if ok_valid:
        return "ignored (accepts the invalid example)"
    return "rejects the valid example" + ("" if not ok_invalid else " and accepts the invalid")


def _rollback_works(backend: Backend, kept: Any, tokens: list[int]) -> str:
    """Consume 6 tokens, roll 4 back: the mask must be the one seen after 2, and the
    rest of the instance must still go through."""
    m = backend.from_kept(kept)
    a, b = backend.new_bitmask(1), backend.new_bitmask(1)
    for t in tokens[:2]:
        backend.consume(m, t)
    backend.fill(m, a, 0)
    for t in tokens[2:6]:
        backend.consume(m, t)
    try:
        backend.rollback(m, 4)
    except Exception as e:   # noqa: BLE001
        return f"error: {e}"
    backend.fill(m, b, 0)
    same = np.array_equal(backend.bits(a), backend.bits(b))
    rest = all(backend.consume(m, t) for t in tokens[2:])
    return "yes" if same and rest and backend.is_done(m) else "wrong state after rollback"


def measure_features(backend: Backend, tokens: list[int]) -> dict[str, Any]:
    """The probes, the rollback check and the error texts of one backend."""
    out: dict[str, Any] = {}
    for feature, g, valid, invalid in FEATURE_PROBES:
        out[feature] = _probe(backend, lambda g=g: backend.compile_cold(g)[0], valid, invalid)
    call = ('Weather first. <function=get_weather>{"city":"Paris"}</function>',
            '<function=get_weather>{"town":"Paris"}</function>')
    try:
        out["structural tag (tool call in text)"] = _probe(
            backend, lambda: backend.structural_tag("<function=", "<function=get_weather>",
                                                    _TOOL, "</function>"), *call)
    except Exception as e:   # noqa: BLE001 - an API that differs from the one expected
        out["structural tag (tool call in text)"] = f"error: {type(e).__name__}: {e}"[:200]
    _, kept = backend.compile_cold(grammar_kinds()["json_schema (medium)"])
    out["rollback (speculative decoding)"] = _rollback_works(backend, kept, tokens)
    errors = {}
    for what, g in INVALID_INPUTS:
        try:
            backend.compile_cold(g)
            errors[what] = "ACCEPTED (no error)"
        except CompileError as e:
            errors[what] = _one_line(e, 300)
    return {"probes": out, "invalid_input_errors": errors, "api": backend.api()}


def _text(x: Any) -> Any:
    """A table cell: strings on one line, with `|` escaped for Markdown."""
    return _one_line(x).replace("|", "\\|") if isinstance(x, str) else x


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table whose cells may hold library messages (newlines, `|`)."""
    return markdown_table(headers, [[_text(x) for x in r] for r in rows])


def feature_tables(backends: dict[str, Any], names: list[str]) -> list[str]:
    """The Markdown of the features and of the error texts of `names` side by side."""
    if not names:
        return []

    def side_by_side(section: str) -> list[list[Any]]:   # rows in the first's order
        return [[k] + [backends[n]["features"][section].get(k) for n in names]
                for k in backends[names[0]]["features"][section]]

    return ["## Features (\"yes\": compiles, accepts a valid example, rejects an "
            "invalid one)", "",
            text_table(["feature", *names], side_by_side("probes") + side_by_side("api")), "",
            "## Error text for invalid inputs", "",
            text_table(["input", *names], side_by_side("invalid_input_errors")), ""]
