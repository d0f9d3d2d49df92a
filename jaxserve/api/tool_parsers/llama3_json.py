"""`llama3_json`: Llama 3.1 / 3.2 JSON tool calls.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

The output is a call only when it *begins* (after whitespace) with `<|python_tag|>` or
`{`: then it is one JSON object, or several separated by `;`. "arguments" is accepted for
"parameters". Anything else is content as it stands; text that follows complete calls
and is not a `;` or another object is content too.

Malformed input. When the first object is not a call (invalid JSON, no string "name",
parameters that are not an object, output ending inside it, `<|python_tag|>` followed by
something other than JSON, e.g. a built-in tool's code) the whole output from there on is
content, tag included; the same holds for an object after a `;`. In a stream a call is
announced once its name has arrived; if the object breaks after that, what was streamed
stays, and its raw text that was not streamed plus everything after it become content.
"""
from __future__ import annotations

from jaxserve.api.tool_parsers.json_call import JsonObjectCalls

TAG = "<|python_tag|>"


class Llama3JsonToolParser(JsonObjectCalls):
    name = "llama3_json"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._state = "start"

    def _advance(self, final: bool) -> None:
        while True:
            st = self._state
            if st == "plain":
                self._text(self._buf)
                self._buf = ""
                return
            head = self._buf.lstrip()
            ws = self._buf[:len(self._buf) - len(head)]
            if st == "start":
                if head.startswith(TAG):
                    self._raw += ws + TAG
                    self._buf, self._state = head[len(TAG):], "expect"
                elif head.startswith("{"):
                    self._state = "expect"
                elif not final and TAG.startswith(head):
                    return
                else:
                    self._reject()
            elif st == "expect":                    # an object must come next
                started = self._start_object(final)
                if started == "wait":
                    return
                if started == "reject":
                    self._reject()
                    continue
                self._state = "object"
            elif st == "object":
                result = self._read_object(final)
                if result == "wait":
                    return
                if result == "reject":
                    self._reject()
                else:
                    self._state = "after" if result == "done" else "plain"
                    self._raw = ""
            else:                                   # "after" a call: ';', '{' or the end
                if not head:
                    return
                if head[0] == ";":
                    self._raw = ws + ";"
                    self._buf, self._state = head[1:], "expect"
                elif head[0] == "{":
                    self._raw, self._buf, self._state = ws, head, "expect"
                else:
                    self._state = "plain"

    def _reject(self) -> None:
        """Not a call: everything held since it began, and all that follows, is content."""
        self._buf = self._raw + self._buf
        self._raw, self._state = "", "plain"
