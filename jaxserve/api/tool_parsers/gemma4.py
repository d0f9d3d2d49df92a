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
# The states whose whitespace is content (or belongs to a tag); in the others it only
# separates tokens.
_RAW_STATES = ("text", "kw", "name", "str")


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

    def _advance(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        """One move of the state machine: False when it must wait for more output."""
        st = self._state
        if st not in _RAW_STATES:
            self._buf = self._buf.lstrip()                # whitespace between tokens
            if not self._buf and st != "end":
                return self._starved(final)
        return getattr(self, "_in_" + st)(final)

    def _starved(self, final: bool) -> bool:
        """The output stopped inside a call: wait for more, or (at its end) it broke."""
        if final:
            self._fail()
        return final

    def _in_text(self, final: bool) -> bool:
        if not self._text_until(START, final):
            return False
        self._raw, self._state = START, "kw"
        return True

    def _in_kw(self, final: bool) -> bool:
        if self._buf.startswith("call:"):
            self._raw += "call:"
            self._buf, self._state = self._buf[5:], "name"
        elif not final and "call:".startswith(self._buf):
            return False
        else:
            self._reject()
        return True

    def _in_name(self, final: bool) -> bool:
        i = self._buf.find("{")
        name = self._buf[:i] if i >= 0 else self._buf
        if (name and not _NAME.match(name)) or (i < 0 and final) or i == 0:
            self._reject()
            return True
        if i < 0:
            return False
        if not self._may_commit(final):
            self._reject()
            return True
        self._buf = self._buf[i + 1:]
        self._begin_call(name)
        self._json, self._frames = "", [["{", 0]]
        self._emit("{")
        self._state = "key"
        return True

    def _in_str(self, final: bool) -> bool:
        """Inside <|"|> ... <|"|>."""
        j = self._buf.find(Q)
        if j >= 0:
            self._emit(_esc(self._buf[:j]) + '"')
            self._buf, self._state = self._buf[j + len(Q):], "after"
            return True
        cut = len(self._buf) - (0 if final else partial_suffix(self._buf, Q))
        self._emit(_esc(self._buf[:cut]))
        self._buf = self._buf[cut:]
        return self._starved(final)

    def _in_key(self, final: bool) -> bool:
        """A key, or '}'."""
        buf = self._buf
        if buf[0] == "}":
            self._close()
            return True
        if buf.startswith(Q):
            j = buf.find(Q, len(Q))
            if j < 0:
                return self._starved(final)
            key, rest = buf[len(Q):j], buf[j + len(Q):].lstrip()
            if rest and rest[0] != ":":
                self._fail()
                return True
        else:
            j = buf.find(":")
            key = (buf if j < 0 else buf[:j]).strip()
            if any(c in key for c in '{}[],<"\n') or (j >= 0 and not key):
                if not (j < 0 and Q.startswith(buf)):
                    self._fail()
                    return True
            if j < 0:
                return self._starved(final)
            rest = buf[j:]
        if not rest:                                      # wait for the ':'
            return self._starved(final)
        self._emit(self._item() + json.dumps(key, ensure_ascii=False) + ": ")
        self._buf, self._state = rest[1:], "value"
        return True

    def _in_value(self, final: bool) -> bool:
        buf = self._buf
        if buf.startswith(Q):
            self._emit(self._item_if_array() + '"')
            self._buf, self._state = buf[len(Q):], "str"
        elif Q.startswith(buf):
            return self._starved(final)
        elif buf[0] in "{[":
            self._emit(self._item_if_array() + buf[0])
            self._frames.append([buf[0], 0])
            self._buf, self._state = buf[1:], "key" if buf[0] == "{" else "first"
        elif buf[0] in ",}]<":
            self._fail()
        else:
            self._state = "bare"
        return True

    def _in_first(self, final: bool) -> bool:
        """Just after '[': ']' or a value."""
        if self._buf[0] == "]":
            self._close()
        else:
            self._state = "value"
        return True

    def _in_bare(self, final: bool) -> bool:
        """A number, true, false, null, ..."""
        buf = self._buf
        ends = [j for c in ",}]<" if (j := buf.find(c)) >= 0]
        if not ends:
            return self._starved(final)
        j = min(ends)
        self._emit(self._item_if_array() + bare_value(buf[:j].strip()))
        self._buf, self._state = buf[j:], "after"
        return True

    def _in_after(self, final: bool) -> bool:
        """',' or the closing bracket."""
        buf, top = self._buf, self._frames[-1][0]
        if buf[0] == ",":
            self._buf, self._state = buf[1:], ("key" if top == "{" else "value")
        elif buf[0] == {"{": "}", "[": "]"}[top]:
            self._close()
        else:
            self._fail()
        return True

    def _in_end(self, final: bool) -> bool:
        """The end tag, if it comes."""
        buf = self._buf
        if buf.startswith(END):
            self._buf = buf[len(END):]
        elif END.startswith(buf):
            if not final:
                return False
            self._buf = ""
        self._finish_call()
        return True

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
