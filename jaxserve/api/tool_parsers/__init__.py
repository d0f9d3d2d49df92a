"""Tool-call parsers: turn a model's raw output into OpenAI `tool_calls`, whole or streamed.

Chosen by `--tool-call-parser NAME` (with `--enable-auto-tool-choice`), as in vLLM. Each
parser is pure Python; one instance serves one request (`feed()` ... `finish()`), and
`extract()` parses a whole output. See base.py for how streaming and whole-text parsing
are kept equal, and each parser's module for its format and what it does with malformed
output.
"""
from __future__ import annotations

from jaxserve.api.tool_parsers.base import (DeltaMessage, DeltaToolCall, ExtractedToolCalls,
                                            ToolCall, ToolParser)
from jaxserve.api.tool_parsers.gemma4 import Gemma4ToolParser
from jaxserve.api.tool_parsers.hermes import HermesToolParser
from jaxserve.api.tool_parsers.llama3_json import Llama3JsonToolParser
from jaxserve.api.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Qwen3CoderToolParser,
                              Llama3JsonToolParser, Gemma4ToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "DeltaMessage", "DeltaToolCall", "ExtractedToolCalls",
           "ToolCall", "ToolParser", "get_tool_parser"]
