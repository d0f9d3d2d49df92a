"""Values a client sent, as a log line shows them: each cut to --max-log-len characters,
and built from a bounded part of it (a 30 MB allowed_token_ids list once made a 42 MB
log line, and took seconds of the event loop to format)."""
from __future__ import annotations

import dataclasses
import reprlib
from typing import Any

from jaxserve.api.errors import clip

# Default of --max-log-len (vLLM's flag; its default is unbounded).
DEFAULT_MAX_LOG_LEN = 1000


class _Bounded(reprlib.Repr):
    """reprlib's bounded repr, which also opens dataclasses (SamplingParams and the
    constraint inside it) field by field instead of calling their full repr."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.maxstring = self.maxother = self.maxlong = limit
        # an element takes a few characters at least: more could not be shown anyway
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = \
            self.maxdeque = self.maxarray = max(1, limit // 4)
        self.maxlevel = 4

    def repr_instance(self, x: Any, level: int) -> str:
        if not dataclasses.is_dataclass(x) or isinstance(x, type) or _own_repr(x):
            return super().repr_instance(x, level)
        if level <= 0:
            return f"{type(x).__name__}(...)"
        fields = ", ".join(
            f"{f.name}={clip(self.repr1(getattr(x, f.name), level - 1), self.limit)}"
            for f in dataclasses.fields(x) if f.repr)
        return f"{type(x).__name__}({fields})"


def loggable(value: Any, max_len: int = DEFAULT_MAX_LOG_LEN) -> str:
    """repr(value) with every value in it (a dataclass's fields each) at most max_len
    characters, at a cost bounded by max_len whatever the value's size."""
    text = _Bounded(max_len).repr(value)
    # (a dataclass's fields are cut one by one already)
    return text if dataclasses.is_dataclass(value) else clip(text, max_len)


def _own_repr(x: Any) -> bool:
    """A dataclass that writes its own bounded repr (StructuredOutputsParams: kind and
    size, never a grammar's text); the generated one is wrapped (dataclasses'
    recursive-repr guard), a hand-written one is not."""
    return not hasattr(type(x).__repr__, "__wrapped__")
