"""What the grammar backends are measured on: the grammars a request can carry (one per
kind, the same text for both backends where their syntax allows) and a valid instance
of the medium schema that the mask drives walk through."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MEDIUM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000000},
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "email": {"type": "string", "format": "email"},
        "signup_date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "status": {"enum": ["active", "suspended", "deleted"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "verified": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "FR", "DE", "JP", "BR"]},
            },
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["id", "name", "email", "status", "age", "verified", "address", "orders"],
    "additionalProperties": False,
}

# A valid instance of MEDIUM_SCHEMA, properties in schema order (both backends generate
# them in that order), written compactly.
MEDIUM_INSTANCE: dict[str, Any] = {
    "id": 48213,
    "name": "Ada Lovelace",
    "email": "ada.lovelace@example.com",
    "signup_date": "2024-03-17",
    "status": "active",
    "age": 36,
    "score": 97.25,
    "verified": True,
    "tags": ["math", "engines", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001",
                "country": "US"},
    "orders": [{"sku": "ENG-0001", "quantity": 2, "price": 1843.5},
               {"sku": "NTE-0042", "quantity": 1, "price": 12.99}],
    "notes": None,
}

SMALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string"},
                   "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}

EMAIL_REGEX = r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9-]+(\.[a-zA-Z0-9-]+)*\.[a-zA-Z]{2,}"
CHOICES = ["positive", "negative", "neutral", "mixed"]
ARITH_LARK = r"""start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")" | "-" factor
NUMBER: /[0-9]+(\.[0-9]+)?/
"""
ARITH_GBNF = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")" | "-" factor
number ::= [0-9]+ ("." [0-9]+)?
"""


@dataclass(frozen=True)
class Grammar:
    """A constraint as a request carries it: `kind` (json_schema, json_object, regex,
    choice, grammar, lark, gbnf, structural_tag) and its text."""
    kind: str
    text: str


def schema_grammar(schema: dict[str, Any]) -> Grammar:
    return Grammar("json_schema", json.dumps(schema))


def grammar_kinds() -> dict[str, Grammar]:
    """The grammars whose compile time is measured, by row name."""
    return {
        "json_schema (medium)": schema_grammar(MEDIUM_SCHEMA),
        "json_schema (small)": schema_grammar(SMALL_SCHEMA),
        "json_object": Grammar("json_object", ""),
        "regex (email)": Grammar("regex", EMAIL_REGEX),
        "choice (4)": Grammar("choice", json.dumps(CHOICES)),
        "grammar (arithmetic)": Grammar("grammar", ARITH_LARK),
    }


def instance_text() -> str:
    """MEDIUM_INSTANCE written compactly, as a model would generate it."""
    return json.dumps(MEDIUM_INSTANCE, separators=(",", ":"))


def instance_tokens(hf_tokenizer: Any) -> list[int]:
    """The valid medium-schema instance as the tokenizer encodes it, then EOS."""
    return hf_tokenizer.encode(instance_text(), add_special_tokens=False) + \
        [hf_tokenizer.eos_token_id]
