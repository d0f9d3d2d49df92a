"""`hermes`: Hermes 2 Pro / Qwen2.5 / Qwen3 JSON calls in `<tool_call>` tags.

    I'll look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Any number of blocks, with text before, between or after them (all of it is content).
"parameters" is accepted for "arguments"; arguments may also be null / missing ("{}") or
a string holding a JSON object. The arguments are streamed as the model's own JSON text.

Malformed input. A block that is not a call (no JSON object after the tag, invalid JSON,
no string "name", arguments that are not an object, the output ending inside the object)
is content, tag and all, and parsing goes on after its `<tool_call>` tag. A call whose
JSON object is complete but lacks `</tool_call>` (end of output, or other text follows)
is still a call. In a stream, a call is announced once its name has arrived; if the
block breaks after that (invalid JSON further on, or the stream ends inside the object),
what was streamed stays as it is, the call's raw text that was not streamed becomes
content and parsing goes on as plain text from the first character that did not fit.
"""
from __future__ import annotations

from jaxserve.api.tool_parsers.json_call import JsonObjectCalls

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(JsonObjectCalls):
    name = "hermes"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._state = "text"

    def _advance(self, final: bool) -> None:
        while True:
            if self._state == "text":
                if not self._text_until(START, final):
                    return
                self._raw, self._state = START, "open"
            elif self._state == "open":             # whitespace, then the object
                started = self._start_object(final)
                if started == "wait":
                    return
                if started == "reject":
                    self._reject()
                    continue
                self._state = "object"
            elif self._state == "object":
                result = self._read_object(final)
                if result == "wait":
                    return
                if result == "reject":
                    self._reject()
                else:
                    self._state = "close" if result == "done" else "text"
            else:                                   # "close": the end tag, if it comes
                rest = self._buf.lstrip()
                if rest.startswith(END):
                    self._buf = rest[len(END):]
                elif END.startswith(rest):
                    if not final:
                        return
                    self._buf = ""
                self._state = "text"

    def _reject(self) -> None:
        """Not a call: the tag is content, and what followed it is read again as text."""
        self._text(START)
        self._buf = self._raw[len(START):] + self._buf
        self._raw, self._state = "", "text"
