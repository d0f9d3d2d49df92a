"""One chat choice's output -> an OpenAI assistant message (content, reasoning_content,
tool_calls), whole or as stream deltas.

The reasoning parser (--reasoning-parser) runs first and splits off the think block;
what remains is read for tool calls: by the --tool-call-parser for tool_choice "auto",
by the llama3_json parser for "required" (the grammar forced that format), and as the
arguments object itself for a named function. Streamed deltas add up to the whole
message (the parsers guarantee it). With parallel_tool_calls false only the first call
is kept (streamed: the deltas of call index 0), as vLLM.
"""
from __future__ import annotations

from typing import Any

from jaxserve.api.reasoning_parsers import END as REASONING_END
from jaxserve.api.reasoning_parsers import START as REASONING_START
from jaxserve.api.reasoning_parsers import ReasoningParser
from jaxserve.api.tool_parsers import DeltaToolCall, ToolCall
from jaxserve.api.tool_parsers.base import new_call_id
from jaxserve.api.tools import ToolSetup


def prompt_ends_in_reasoning(prompt_tail: str) -> bool:
    """Whether the chat template opened a think block the model is to close (Qwen3.5/3.6
    and DeepSeek-R1 templates end the prompt with "<think>\\n")."""
    return prompt_tail.rfind(REASONING_START) > prompt_tail.rfind(REASONING_END)


def _call_json(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _delta_json(d: DeltaToolCall) -> dict:
    out: dict[str, Any] = {"index": d.index}
    fn: dict[str, Any] = {}
    if d.id is not None:
        out.update(id=d.id, type="function")
    if d.name is not None:
        fn["name"] = d.name
    fn["arguments"] = d.arguments
    out["function"] = fn
    return out


class ChoiceReader:
    def __init__(self, tools: ToolSetup, reasoning: type[ReasoningParser] | None,
                 in_reasoning: bool, role: str = "assistant"):
        self.tools = tools
        self.role = role
        self.reasoning = reasoning(prompt_ends_in_reasoning=in_reasoning) if reasoning else None
        self.parser = tools.parser(tools.tools) if tools.mode in ("auto", "required") else None
        self._named_id: str | None = None
        self.called = False

    # ---- whole ---------------------------------------------------------------------------
    def message(self, text: str) -> dict:
        reasoning, content = (self.reasoning.extract(text) if self.reasoning
                              else (None, text))
        msg: dict[str, Any] = {"role": self.role, "content": content}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        calls: list[ToolCall] = []
        if self.tools.mode == "named":
            calls, msg["content"] = [ToolCall(new_call_id(), self.tools.name,
                                              content or "{}")], None
        elif self.parser is not None and content:
            found = self.parser.extract(content)
            calls, msg["content"] = found.tool_calls, found.content
        if not self.tools.parallel:
            calls = calls[:1]
        if calls:
            msg["tool_calls"] = [_call_json(c) for c in calls]
            self.called = True
        return msg

    # ---- streamed ------------------------------------------------------------------------
    def delta(self, text: str, final: bool) -> dict:
        """The delta message for the next piece of output (final: the last piece)."""
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                r, c = self.reasoning.finish()
                reasoning, content = reasoning + r, content + c
        out: dict[str, Any] = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        calls: list[DeltaToolCall] = []
        if self.tools.mode == "named":
            if content or (final and self._named_id is None):
                first = self._named_id is None
                self._named_id = self._named_id or new_call_id()
                calls = [DeltaToolCall(0, self._named_id if first else None,
                                       self.tools.name if first else None,
                                       content or ("{}" if first else ""))]
            content = ""
        elif self.parser is not None:
            pieces = [self.parser.feed(content)] + ([self.parser.finish()] if final else [])
            content = "".join(p.content for p in pieces)
            calls = [d for p in pieces for d in p.tool_calls
                     if self.tools.parallel or d.index == 0]
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = [_delta_json(d) for d in calls]
            self.called = True
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """"tool_calls" when the model called tools ("auto" / "required"), as OpenAI; a
        named function's forced call ends with "stop", as OpenAI's do."""
        if engine_reason == "stop" and self.called and self.tools.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason
