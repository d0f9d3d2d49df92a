"""`qwen3_coder`: the XML calls of Qwen3-Coder, Qwen3.5 and Qwen3.6.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text: one leading and one trailing newline are removed, then
the value is turned into JSON by the parameter's type in the request's `tools` schema
(integer / number / boolean / object / array / null parsed where valid, string kept as
text, unknown type: JSON if it parses, else text). String values stream as they are
generated; other values go out whole when their parameter ends. A missing `</parameter>`
is tolerated (the next `<parameter=`, `</function>` or `</tool_call>` ends the value), and
so is a missing `</function>` before `</tool_call>` or at the end of the output. Several
`<function=...>` blocks inside one `<tool_call>` are several calls.

Malformed input. A block that does not start with `<function=NAME>` is content, tag and
all, and parsing goes on after the tag. A call that breaks after its name (text between
parameters, a parameter name without `>`, the output ending inside a value) is content as
a whole in `extract()`; in a stream, where the call was already announced, what was
streamed stays, a value held back for conversion becomes content, and parsing goes on as
plain text from the first character that did not fit.
"""
from __future__ import annotations

import ast
import json

from jaxserve import json_limits
from jaxserve.api.tool_parsers.base import ToolParser, schema_types

START, END = "<tool_call>", "</tool_call>"
FN, FN_END = "<function=", "</function>"
P, P_END = "<parameter=", "</parameter>"
VALUE_ENDS = (P_END, P, FN_END, END)          # the first one consumed, the others not
STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}


def _kind(t: object) -> str:
    """A schema 'type' reduced to string / integer / number / boolean / container / null /
    unknown."""
    if isinstance(t, list):
        rest = [x for x in t if x != "null"]
        t = rest[0] if len(rest) == 1 else ("string" if "string" in rest else None)
    if not isinstance(t, str):
        return "unknown"
    t = t.lower()
    if t in STRING_TYPES:
        return "string"
    if t.startswith("int") or t in ("uint", "long", "short"):
        return "integer"
    if t.startswith(("num", "float", "double")):
        return "number"
    if t.startswith("bool"):
        return "boolean"
    if t in ("object", "array", "dict", "list") or t.startswith(("dict", "list")):
        return "container"
    return "null" if t == "null" else "unknown"


def convert(raw: str, kind: str) -> str:
    """The JSON text of a non-string parameter value (falls back to a JSON string)."""
    v = raw.strip()
    value: object = raw
    if v == "null":
        value = None
    elif kind == "integer":
        try:
            value = int(v)
        except ValueError:
            try:
                f = float(v)
                value = int(f) if f.is_integer() else f
            except ValueError:
                pass
    elif kind == "number":
        try:
            value = int(v) if v.lstrip("-").isdigit() else float(v)
        except ValueError:
            pass
    elif kind == "boolean":
        if v.lower() in ("true", "false"):
            value = v.lower() == "true"
    elif kind != "null":                           # container or unknown: try JSON
        try:
            value = json_limits.loads(v)
        except ValueError:
            if kind == "container":
                try:                               # Python-style {'a': 1} / [1, 2]
                    lit = ast.literal_eval(v)
                    value = lit if isinstance(lit, (dict, list)) else raw
                except (ValueError, SyntaxError, MemoryError, RecursionError):
                    pass
        if kind == "container" and not isinstance(value, (dict, list)):
            value = raw
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):                # NaN, sets, ...: keep the text
        return json.dumps(raw, ensure_ascii=False)


def _esc(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)[1:-1]


def _value_hold(buf: str) -> int:
    """Tail of a value to hold back: a newline and/or the start of a closing tag."""
    for k in range(min(len(buf), 13), 0, -1):
        tail = buf[-k:]
        tail = tail[1:] if tail[0] == "\n" else tail
        if any(t.startswith(tail) for t in VALUE_ENDS):
            return k
    return 0


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    _SHARED = ("tools", "_types")

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._types = schema_types(self.tools)
        self._state = "text"
        self._tag = ""            # the tag that began the attempt (START or FN)
        self._raw = ""            # text held since that tag
        self._fn = ""
        self._nparams = 0
        self._kind = "unknown"
        self._started = False     # first character of the value seen
        self._val = ""            # a non-string value held until its end

    def _advance(self, final: bool) -> None:
        # One move per state until one must wait for more output.
        while getattr(self, "_in_" + self._state)(final):
            pass

    def _in_text(self, final: bool) -> bool:
        if not self._text_until(START, final):
            return False
        self._tag = self._raw = START
        self._state = "open"
        return True

    def _in_open(self, final: bool) -> bool:
        """Just after <tool_call>: <function=, or this was no call."""
        buf = self._buf
        head = buf.lstrip()
        if head.startswith(FN):
            self._raw += buf[:len(buf) - len(head) + len(FN)]
            self._buf, self._state = head[len(FN):], "fname"
        elif not final and FN.startswith(head):
            return False
        else:
            self._reject()
        return True

    def _in_after_fn(self, final: bool) -> bool:
        """After </function>: another <function=, or </tool_call>."""
        head = self._buf.lstrip()
        if head.startswith(FN):
            self._tag = self._raw = FN
            self._buf, self._state = head[len(FN):], "fname"
        elif head.startswith(END):
            self._buf, self._state = head[len(END):], "text"
        elif not final and (FN.startswith(head) or END.startswith(head)):
            return False
        else:
            if final and END.startswith(head):
                self._buf = ""                     # a cut-off </tool_call>
            self._state = "text"
        return True

    def _in_fname(self, final: bool) -> bool:
        buf = self._buf
        i = buf.find(">")
        name = (buf[:i] if i >= 0 else buf).strip()
        if "\n" in name or "<" in name or len(name) > 256 or \
                (i >= 0 and not name) or (i < 0 and final):
            self._reject()
            return True
        if i < 0:
            return False
        if not self._may_commit(final):
            self._reject()
            return True
        self._buf = buf[i + 1:]
        self._begin_call(name)
        self._fn, self._nparams, self._state = name, 0, "params"
        return True

    def _in_params(self, final: bool) -> bool:
        """Between parameters: the next <parameter=, or the call's end."""
        head = self._buf.lstrip()
        self._buf = head
        if head.startswith(P):
            self._buf, self._state = head[len(P):], "pname"
        elif head.startswith((FN_END, END)) or \
                (final and (FN_END.startswith(head) or END.startswith(head))):
            self._args("}" if self._nparams else "{}")
            self._end_call(True)
            if head.startswith(FN_END):
                self._buf, self._state = head[len(FN_END):], "after_fn"
            else:                                   # </tool_call> or a cut-off end tag
                self._buf, self._state = head[len(END):], "text"
        elif not final and any(t.startswith(head) for t in (P, FN_END, END)):
            return False
        else:
            self._fail()
        return True

    def _in_pname(self, final: bool) -> bool:
        buf = self._buf
        i = buf.find(">")
        key = (buf[:i] if i >= 0 else buf).strip()
        if "\n" in key or "<" in key or (i >= 0 and not key) or (i < 0 and final):
            self._fail()
            return True
        if i < 0:
            return False
        self._buf = buf[i + 1:]
        self._kind = _kind(self._types.get(self._fn, {}).get(key))
        sep = ", " if self._nparams else "{"
        quote = '"' if self._kind == "string" else ""
        self._args(sep + json.dumps(key, ensure_ascii=False) + ": " + quote)
        self._nparams += 1
        self._started, self._val, self._state = False, "", "value"
        return True

    def _in_value(self, final: bool) -> bool:
        buf = self._buf
        if not self._started:
            if not buf:
                if final:
                    self._fail()
                return final
            self._buf = buf = buf[1:] if buf[0] == "\n" else buf
            self._started = True
        ends = [(j, t) for t in VALUE_ENDS if (j := buf.find(t)) >= 0]
        if ends:
            j, t = min(ends)
            part = buf[:j][:-1] if buf[:j].endswith("\n") else buf[:j]
            if self._kind == "string":
                self._args(_esc(part) + '"')
            else:
                self._args(convert(self._val + part, self._kind))
            self._buf = buf[j + (len(t) if t == P_END else 0):]
            self._state = "params"
            return True
        if final:
            self._fail()
            return True
        cut = len(buf) - _value_hold(buf)
        if self._kind == "string":
            self._args(_esc(buf[:cut]))
        else:
            self._val += buf[:cut]
        self._buf = buf[cut:]
        return False

    def _reject(self) -> None:
        """Not a call: the tag is content, and what followed it is read again as text."""
        self._text(self._tag)
        self._buf = self._raw[len(self._tag):] + self._buf
        self._raw, self._state = "", "text"

    def _fail(self) -> None:
        """A call that broke after it was announced (only ever in a stream)."""
        self._text(self._val)
        self._val = ""
        self._end_call(False)
        self._state = "text"
