"""StructuredOutputsParams: what a constrained output must match (vLLM's names).

Host-only (no jax, no grammar library): SamplingParams carries it; the front door
compiles it (jaxserve/engine/grammar.py) and the runner applies it as a token mask.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jaxserve import json_limits
from jaxserve.errors import InputError

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: json (a JSON schema, as a dict or its JSON text), regex, choice (a
    list of strings: the output is one of them), grammar (Lark, or GBNF/EBNF with
    `::=` rules), json_object=True (any JSON object). disable_any_whitespace: JSON
    without optional whitespace. structural_tag is vLLM's; not implemented (refused)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InputError(f"structured_outputs must set exactly one of {', '.join(_KINDS)}; "
                             f"got {', '.join(given) or 'none'}", "structured_outputs")
        if self.structural_tag is not None:
            raise InputError("structured_outputs.structural_tag is not implemented",
                             "structured_outputs")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InputError("structured_outputs.json must be a JSON schema (an object or its "
                             "JSON text)", "structured_outputs")
        if isinstance(self.json, str):   # (JSON text is parsed later, recursively)
            try:
                json_limits.check_depth(self.json)
            except ValueError as e:
                raise InputError(f"structured_outputs.json: {e}", "structured_outputs") from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InputError(f"structured_outputs.{name} must be a non-empty string",
                                 "structured_outputs")
        if self.choice is not None and (
                not isinstance(self.choice, (list, tuple)) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise InputError("structured_outputs.choice must be a non-empty list of non-empty "
                             "strings", "structured_outputs")
        if self.json_object is not None and self.json_object is not True:
            raise InputError("structured_outputs.json_object must be true", "structured_outputs")

    def __repr__(self) -> str:
        """Bounded (a grammar may be megabytes): its kind and size, not its text."""
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        sizes = ", ".join(f"{k}=<{len(str(getattr(self, k)))} chars>" for k in given)
        return f"StructuredOutputsParams({sizes})"

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """One text per distinct constraint: the compiled-grammar cache's key."""
        value: Any = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True,
                          ensure_ascii=False)
