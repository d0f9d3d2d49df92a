"""`gemma4`: Gemma 4's own call syntax (not JSON).

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

This is what the Gemma 4 chat template writes for an assistant's `tool_calls` (its
`format_argument` macro; vLLM's `gemma4` parser reads the same): bare keys, strings
between `<|"|>` delimiters, bare numbers and true/false/null, `{...}` and `[...]`
nesting; several calls follow each other without separator. The arguments are translated
to JSON while they arrive: `{"city": "Paris", "days": 3}`. Keys written between `<|"|>`
are accepted too; a bare value that is not a JSON number or literal (None, True, words)
becomes null / true / false / a string.

Malformed input. A `<|tool_call>` that is not followed by `call:NAME{` is content, tag
and all, and parsing goes on after the tag. A call that breaks after its name (an empty
value, a stray character, the output ending before the closing brace) is content as a
whole in `extract()`; in a stream, where the call was already announced, what was
streamed stays and parsing goes on as plain text from the first character that did not
fit. A complete call is still a call when `<tool_call|>` is missing.
"""
from __future__ import annotations

import json
import math
import re

from jaxserve import json_limits
from jaxserve.api.tool_parsers.base import ToolParser, partial_suffix

START, END, Q = "<|tool_call>", "<tool_call|>", '<|"|>'
_NAME = re.compile(r"[A-Za-z0-9_.:\-]+\Z")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_WORDS = {"true": "true", "false": "false", "null": "null", "True": "true",
          "False": "false", "None": "null", "none": "null", "nil": "null"}


def _esc(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)[1:-1]


def bare_value(token: str) -> str:
    """JSON text for an unquoted Gemma value."""
    if token in _WORDS:
        return _WORDS[token]
    if _NUMBER.match(token):
        return token
    try:
        f = float(token)
        if math.isfinite(f):
            return json.dumps(f)
    except ValueError:
        pass
    return json.dumps(token, ensure_ascii=False)


class Gemma4ToolParser(ToolParser):
    name = "gemma4"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._state = "text"
        self._raw = ""
        self._frames: list[list] = []     # [opening bracket, items so far] per level
        self._json = ""                   # the arguments emitted for the open call

    def _emit(self, s: str) -> None:
        self._json += s
        self._args(s)

    def _item(self) -> str:
        """Separator before the next key or array item."""
        frame = self._frames[-1]
        frame[1] += 1
        return ", " if frame[1] > 1 else ""

    def _advance(self, final: bool) -> None:          # noqa: C901 - one state machine
        while True:
            st = self._state
            if st == "text":
                if not self._text_until(START, final):
                    return
                self._raw, self._state = START, "kw"
                continue
            if st == "kw":
                if self._buf.startswith("call:"):
                    self._raw += "call:"
                    self._buf, self._state = self._buf[5:], "name"
                elif not final and "call:".startswith(self._buf):
                    return
                else:
                    self._reject()
                continue
            if st == "name":
                i = self._buf.find("{")
                name = self._buf[:i] if i >= 0 else self._buf
                if (name and not _NAME.match(name)) or (i < 0 and final) or i == 0:
                    self._reject()
                    continue
                if i < 0:
                    return
                if not self._may_commit(final):
                    self._reject()
                    continue
                self._buf = self._buf[i + 1:]
                self._begin_call(name)
                self._json, self._frames = "", [["{", 0]]
                self._emit("{")
                self._state = "key"
                continue
            if st == "str":                               # inside <|"|> ... <|"|>
                j = self._buf.find(Q)
                if j >= 0:
                    self._emit(_esc(self._buf[:j]) + '"')
                    self._buf, self._state = self._buf[j + len(Q):], "after"
                    continue
                cut = len(self._buf) - (0 if final else partial_suffix(self._buf, Q))
                self._emit(_esc(self._buf[:cut]))
                self._buf = self._buf[cut:]
                if final:
                    self._fail()
                    continue
                return
            self._buf = buf = self._buf.lstrip()          # whitespace between tokens
            if not buf and st != "end":
                if final:
                    self._fail()
                    continue
                return
            if st == "key":                               # a key, or '}'
                if buf[0] == "}":
                    self._close()
                    continue
                if buf.startswith(Q):
                    j = buf.find(Q, len(Q))
                    if j < 0:
                        if final:
                            self._fail()
                            continue
                        return
                    key, rest = buf[len(Q):j], buf[j + len(Q):].lstrip()
                    if rest and rest[0] != ":":
                        self._fail()
                        continue
                else:
                    j = buf.find(":")
                    key = (buf if j < 0 else buf[:j]).strip()
                    if any(c in key for c in '{}[],<"\n') or (j >= 0 and not key):
                        if not (j < 0 and Q.startswith(buf)):
                            self._fail()
                            continue
                    if j < 0:
                        if final:
                            self._fail()
                            continue
                        return
                    rest = buf[j:]
                if not rest:                              # wait for the ':'
                    if final:
                        self._fail()
                        continue
                    return
                self._emit(self._item() + json.dumps(key, ensure_ascii=False) + ": ")
                self._buf, self._state = rest[1:], "value"
            elif st == "value":
                if buf.startswith(Q):
                    self._emit(self._item_if_array() + '"')
                    self._buf, self._state = buf[len(Q):], "str"
                elif Q.startswith(buf):
                    if final:
                        self._fail()
                        continue
                    return
                elif buf[0] in "{[":
                    self._emit(self._item_if_array() + buf[0])
                    self._frames.append([buf[0], 0])
                    self._buf, self._state = buf[1:], "key" if buf[0] == "{" else "first"
                elif buf[0] in ",}]<":
                    self._fail()
                else:
                    self._state = "bare"
            elif st == "first":                           # just after '[': ']' or a value
                if buf[0] == "]":
                    self._close()
                else:
                    self._state = "value"
            elif st == "bare":                            # number, true, false, null, ...
                ends = [j for c in ",}]<" if (j := buf.find(c)) >= 0]
                if not ends:
                    if final:
                        self._fail()
                        continue
                    return
                j = min(ends)
                self._emit(self._item_if_array() + bare_value(buf[:j].strip()))
                self._buf, self._state = buf[j:], "after"
            elif st == "after":                           # ',' or the closing bracket
                top = self._frames[-1][0]
                if buf[0] == ",":
                    self._buf, self._state = buf[1:], ("key" if top == "{" else "value")
                elif buf[0] == {"{": "}", "[": "]"}[top]:
                    self._close()
                else:
                    self._fail()
            else:                                         # "end": the end tag, if it comes
                if buf.startswith(END):
                    self._buf = buf[len(END):]
                elif END.startswith(buf):
                    if not final:
                        return
                    self._buf = ""
                self._finish_call()

    def _item_if_array(self) -> str:
        return self._item() if self._frames[-1][0] == "[" else ""

    def _close(self) -> None:
        bracket = self._frames.pop()[0]
        self._emit("}" if bracket == "{" else "]")
        self._buf = self._buf[1:]
        self._state = "after" if self._frames else "end"

    def _finish_call(self) -> None:
        try:
            ok = isinstance(json_limits.loads(self._json), dict)
        except ValueError:
            ok = False
        self._end_call(ok)
        self._state = "text"

    def _reject(self) -> None:
        """Not a call: the tag is content, and what followed it is read again as text."""
        self._text(START)
        self._buf = self._raw[len(START):] + self._buf
        self._raw, self._state = "", "text"

    def _fail(self) -> None:
        """A call that broke after it was announced (only ever in a stream)."""
        self._end_call(False)
        self._frames, self._state = [], "text"
