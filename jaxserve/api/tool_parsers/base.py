"""What every tool-call parser shares: the result types and the streaming base class.

A parser is one incremental state machine over the model's output text. `feed()` runs it
on what has arrived so far; `finish()` runs it once more knowing nothing else will come;
`extract()` runs a fresh copy on the whole text in that final mode. Streaming and
whole-text parsing therefore share every line of format logic, which is what keeps the
streamed content and calls equal to the extracted ones.

The one place the two modes differ is when a call is *announced* (its id and name sent):
a stream announces it as soon as the name is known, so that arguments can follow while
they are generated; the final mode first runs a copy of the parser over the rest of the
text (`_may_commit`) and only announces a call that that copy saw end well. A malformed
call is therefore plain content in `extract()`, and in a stream too unless its name had
already gone out before the problem showed (see each parser's docstring for that case).
"""
from __future__ import annotations

import copy
import secrets
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    """One complete call: arguments is the JSON text of an object ("{}" when none)."""
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class DeltaToolCall:
    """One streamed piece of call `index`; id and name come only in its first piece."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class DeltaMessage:
    content: str = ""
    tool_calls: tuple[DeltaToolCall, ...] = ()


def new_call_id() -> str:
    """'call_' + 24 hex digits, as OpenAI-style clients expect."""
    return "call_" + secrets.token_hex(12)


def partial_suffix(text: str, *tags: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `tags`:
    the characters a stream must hold back because they may start a tag."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


class ContentSink:
    """Collects the text outside calls.

    Rule (the same for a stream and a whole text): with no call in the output the text is
    kept exactly; once there is a call, whitespace at the very start (before any text) and
    at the very end is dropped, so the newlines around <tool_call> blocks do not reach the
    client. Whitespace is therefore held back until non-space text follows it."""

    def __init__(self) -> None:
        self._out: list[str] = []
        self._held = ""
        self._seen_text = False
        self._seen_call = False

    def add(self, s: str) -> None:
        core = s.rstrip()
        if not core:
            self._held += s
            return
        if self._seen_call and not self._seen_text:
            piece = core.lstrip()
        else:
            piece = self._held + core
        self._out.append(piece)
        self._seen_text = True
        self._held = s[len(core):]

    def call(self) -> None:
        self._seen_call = True
        if not self._seen_text:
            self._held = ""

    def end(self) -> None:
        if not self._seen_call:
            self._out.append(self._held)
        self._held = ""

    def take(self) -> str:
        s = "".join(self._out)
        self._out.clear()
        return s


def schema_types(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    """{function name: {parameter: JSON-schema 'type'}} from an OpenAI `tools` list."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(fn.get("name"), str) and isinstance(props, dict):
            out[fn["name"]] = {k: (v.get("type") if isinstance(v, dict) else None)
                               for k, v in props.items()}
    return out


class ToolParser:
    """Base class: subclasses implement `_advance(final)`, which consumes `self._buf` as far
    as it can be decided and reports through `_text`, `_begin_call`, `_args`, `_end_call`."""

    name: ClassVar[str] = ""
    _SHARED: ClassVar[tuple[str, ...]] = ("tools",)   # read-only: not copied for a probe

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = list(tools or [])
        self._buf = ""
        self._sink = ContentSink()
        self._pieces: list[DeltaToolCall] = []
        self._n_calls = 0                      # calls announced so far
        self._open: int | None = None          # index of the call being streamed
        self._outcomes: list[bool] = []        # per finished call: did it end well
        self._trial = False                    # True in the look-ahead copy

    # ---- public API -------------------------------------------------------------------
    def extract(self, text: str) -> ExtractedToolCalls:
        """Parse a whole output (this parser's streaming state is left untouched)."""
        fresh = type(self)(self.tools)
        fresh._buf = text
        msg = fresh.finish()
        calls: dict[int, list[DeltaToolCall]] = {}
        for piece in msg.tool_calls:
            calls.setdefault(piece.index, []).append(piece)
        found = [ToolCall(ps[0].id or new_call_id(), ps[0].name or "",
                          "".join(p.arguments for p in ps))
                 for i, ps in sorted(calls.items()) if fresh._outcomes[i]]
        content = msg.content if msg.content.strip() else None
        return ExtractedToolCalls(content, found)

    def feed(self, delta_text: str) -> DeltaMessage:
        self._buf += delta_text
        self._advance(final=False)
        return self._take()

    def finish(self) -> DeltaMessage:
        self._advance(final=True)
        if self._open is not None:             # a parser left a call open: close it
            self._end_call(False)
        if self._buf:
            self._text(self._buf)
            self._buf = ""
        self._sink.end()
        return self._take()

    # ---- for subclasses ----------------------------------------------------------------
    def _advance(self, final: bool) -> None:
        raise NotImplementedError

    def _text(self, s: str) -> None:
        if s:
            self._sink.add(s)

    def _text_until(self, tag: str, final: bool) -> bool:
        """Hands out the text before `tag` and consumes the tag: True once it is found;
        else hands out all that cannot be its start and returns False (more must come)."""
        i = self._buf.find(tag)
        if i < 0:
            cut = len(self._buf) - (0 if final else partial_suffix(self._buf, tag))
            self._text(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        self._text(self._buf[:i])
        self._buf = self._buf[i + len(tag):]
        return True

    def _begin_call(self, name: str) -> None:
        self._open = self._n_calls
        self._n_calls += 1
        self._sink.call()
        self._pieces.append(DeltaToolCall(self._open, new_call_id(), name, ""))

    def _args(self, s: str) -> None:
        if s and self._open is not None:
            self._pieces.append(DeltaToolCall(self._open, arguments=s))

    def _end_call(self, ok: bool) -> None:
        self._outcomes.append(ok)
        self._open = None

    def _may_commit(self, final: bool) -> bool:
        """May the call whose name was just read be announced? Always in a stream; in the
        final mode only if a copy of the parser, run to the end, saw that call end well.
        Call it before changing any state, so that the copy re-reaches this point."""
        if not final or self._trial:
            return True
        shared = {id(v): v for v in (getattr(self, a) for a in self._SHARED)}
        probe = copy.deepcopy(self, shared)
        probe._trial = True
        k = probe._n_calls
        probe._advance(final=True)
        return probe._open is None and len(probe._outcomes) > k and probe._outcomes[k]

    def _take(self) -> DeltaMessage:
        merged: list[DeltaToolCall] = []
        for p in self._pieces:
            if merged and merged[-1].index == p.index and p.id is None:
                last = merged[-1]
                merged[-1] = DeltaToolCall(last.index, last.id, last.name,
                                           last.arguments + p.arguments)
            elif p.id is not None or p.arguments:
                merged.append(p)
        self._pieces = []
        return DeltaMessage(self._sink.take(), tuple(merged))
