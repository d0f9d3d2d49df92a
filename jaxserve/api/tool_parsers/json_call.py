"""Incremental reading of one `{"name": ..., "arguments": {...}}` object (hermes, llama3_json).

The arguments are streamed as the model's own JSON text, character for character, while
they arrive. That is only safe if every character handed out is certain to belong to the
final arguments, so the object is run through a strict JSON validator as it grows: the
validator says where each top-level member starts and ends, and stops at the first
character that cannot continue valid JSON.
"""
from __future__ import annotations

import json
import re

from jaxserve import json_limits
from jaxserve.api.tool_parsers.base import ToolParser

_WS = " \t\n\r"
_DIGITS = "0123456789"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_LITERALS = ("true", "false", "null")
_HEX = "0123456789abcdefABCDEF"


class JsonScanner:
    """Strict incremental JSON validator for one value (RFC 8259, as `json.loads` accepts it
    without NaN/Infinity). `members` maps each key of the top-level object to
    [start, end) offsets of its value; end is None while the value is still open."""

    def __init__(self) -> None:
        self.pos = 0
        self.done = False
        self.error = False
        self.members: dict[str, list[int | None]] = {}
        self._stack: list[str] = []
        self._state = "value"
        self._tok = ""          # number / literal being read
        self._esc = 0           # 0 none, 1 after '\', 2..5 inside \uXXXX
        self._in_key = False
        self._key = ""          # raw text of the key being read, then the decoded key
        self._member = ""
        self.token_start: int | None = None   # where an unfinished number / literal began

    def feed(self, text: str) -> int:
        """Consume characters until the value ends or one is invalid; return how many."""
        i = 0
        while i < len(text) and not self.done and not self.error:
            if self._step(text[i]):
                i += 1
                self.pos += 1
        return i

    # one character; False = not consumed (an error, or a number's terminator to re-read)
    def _step(self, c: str) -> bool:
        st = self._state
        if st == "str":
            return self._string(c)
        if st == "num":
            if c in "0123456789+-.eE":
                self._tok += c
                return True
            if not _NUMBER.match(self._tok):
                return self._fail()
            self._end_value(self.pos)
            return False
        if st == "lit":
            tok = self._tok + c
            if not any(lit.startswith(tok) for lit in _LITERALS):
                return self._fail()
            self._tok = tok
            if tok in _LITERALS:
                self._end_value(self.pos + 1)
            return True
        if c in _WS:
            return True
        if st == "value" or (st == "first" and c != "]"):
            return self._begin(c)
        if st == "first" or (st == "key0" and c == "}"):
            return self._close()
        if st in ("key0", "key"):
            if c != '"':
                return self._fail()
            self._state, self._in_key, self._key = "str", True, '"'
            return True
        if st == "colon":
            if c != ":":
                return self._fail()
            self._state = "value"
            return True
        if st == "after":
            top = self._stack[-1]
            if c == ",":
                self._state = "key" if top == "{" else "value"
                return True
            if (c == "}" and top == "{") or (c == "]" and top == "["):
                return self._close()
        return self._fail()

    def _begin(self, c: str) -> bool:
        if self._stack == ["{"]:
            self._member = self._key
            self.members[self._key] = [self.pos, None]
        if c == "{":
            self._stack.append("{")
            self._state = "key0"
        elif c == "[":
            self._stack.append("[")
            self._state = "first"
        elif c == '"':
            self._state, self._in_key = "str", False
        elif c == "-" or c in _DIGITS:
            self._state, self._tok, self.token_start = "num", c, self.pos
        elif c in "tfn":
            self._state, self._tok, self.token_start = "lit", c, self.pos
        else:
            return self._fail()
        return True

    def _string(self, c: str) -> bool:
        if self._esc == 1:
            if c == "u":
                self._esc = 2
            elif c in '"\\/bfnrt':
                self._esc = 0
            else:
                return self._fail()
        elif self._esc >= 2:
            if c not in _HEX:
                return self._fail()
            self._esc = 0 if self._esc == 5 else self._esc + 1
        elif c == "\\":
            self._esc = 1
        elif c == '"':
            if self._in_key:
                self._key = json.loads(self._key + '"')
                self._in_key = False
                self._state = "colon"
            else:
                self._end_value(self.pos + 1)
            return True
        elif c < " ":
            return self._fail()
        if self._in_key:
            self._key += c
        return True

    def _close(self) -> bool:
        self._stack.pop()
        self._end_value(self.pos + 1)
        return True

    def _end_value(self, end: int) -> None:
        self.token_start = None
        if not self._stack:
            self.done, self._state = True, "end"
            return
        if self._stack == ["{"]:
            self.members[self._member][1] = end
        self._state = "after"

    def _fail(self) -> bool:
        self.error = True
        return False


class JsonCallReader:
    """One call object as it arrives: `name` once its string is complete; `take_args()`
    hands out the arguments JSON text not yet handed out. `bad` is set when the object
    cannot be a call (invalid JSON, name not a string, arguments not an object)."""

    ARG_KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        self.scan = JsonScanner()
        self.obj = ""
        self.name: str | None = None
        self.bad = False
        self.shown = 0          # offset in obj up to which the call represents the text
        self._sent = 0          # chars of object-valued arguments already handed out
        self._args_closed = False
        self._arg_key: str | None = None

    @property
    def complete(self) -> bool:
        return self.scan.done

    def push(self, text: str) -> int:
        n = self.scan.feed(text)
        self.obj += text[:n]
        if self.scan.error:
            self.bad = True
        m = self.scan.members.get("name")
        if self.name is None and m is not None and m[1] is not None:
            try:   # (valid JSON, but maybe nested too deep for the parser)
                value = json_limits.loads(self.obj[m[0]:m[1]])
            except ValueError:
                value = None
            if isinstance(value, str) and value.strip():
                self.name = value
                self.shown = max(self.shown, m[1])
            else:
                self.bad = True
        if self.complete and self.name is None:
            self.bad = True
        return n

    def _arg_member(self) -> list[int | None] | None:
        if self._arg_key is None:   # the first of the two keys to appear wins for good
            self._arg_key = next((k for k in self.ARG_KEYS if k in self.scan.members), None)
        return None if self._arg_key is None else self.scan.members[self._arg_key]

    def take_args(self) -> str:
        m = self._arg_member()
        if m is None:
            if self.complete and not self._args_closed:
                self._args_closed = True
                return "{}"
            return ""
        start, end = m
        assert start is not None
        kind = self.obj[start]
        if kind == "{":                      # stream the model's own text
            stop = end if end is not None else len(self.obj)
            if end is None and self.scan.token_start is not None:
                stop = self.scan.token_start  # a number / literal may still grow
            piece = self.obj[start + self._sent:stop]
            self._sent = stop - start
            self.shown = max(self.shown, stop)
            return piece
        if kind not in '"n':                 # an array, number or boolean: not arguments
            self.bad = True
            return ""
        if end is None or self._args_closed:
            return ""
        self._args_closed = True
        self.shown = max(self.shown, end)
        value = json.loads(self.obj[start:end])
        if value is None:
            return "{}"
        try:                                 # arguments given as a string of JSON
            inner = json_limits.loads(value)
        except ValueError:
            inner = None
        if not isinstance(inner, dict):
            self.bad = True
            return ""
        return json.dumps(inner, ensure_ascii=False)


class JsonObjectCalls(ToolParser):
    """Base of the parsers whose calls are JSON objects: reads one object from `_buf`.
    Subclasses set `_reader` (a fresh JsonCallReader) and `_raw` (the raw text held since
    the call began) before calling `_read_object`."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._reader = JsonCallReader()
        self._raw = ""

    def _start_object(self, final: bool) -> str:
        """Whitespace, then the call's '{': 'wait' (nothing yet), 'reject' (something
        else comes) or 'started' (the whitespace joins the held text, a reader begins)."""
        body = self._buf.lstrip()
        if not body and not final:
            return "wait"
        if not body.startswith("{"):
            return "reject"
        self._raw += self._buf[:len(self._buf) - len(body)]
        self._buf, self._reader = body, JsonCallReader()
        return "started"

    def _read_object(self, final: bool) -> str:
        """'wait' (need more text), 'reject' (not a call; nothing was announced), 'done'
        (call complete) or 'failed' (announced, then broke: see the parser docstrings)."""
        r = self._reader
        n = r.push(self._buf)
        self._raw += self._buf[:n]
        self._buf = self._buf[n:]
        if self._open is None:
            if r.bad or (r.name is None and final):
                return "reject"
            if r.name is None:
                return "wait"
            if not self._may_commit(final):
                return "reject"
            self._begin_call(r.name)
        self._args(r.take_args())
        if r.bad or (final and not r.complete):
            # keep what was streamed; the raw text the call does not cover becomes content
            self._text(r.obj[r.shown:])
            self._end_call(False)
            return "failed"
        if r.complete:
            self._end_call(True)
            return "done"
        return "wait"
