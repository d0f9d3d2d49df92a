"""Tool calling: what a chat request's `tools` / `tool_choice` ask for, and the grammar
that forces a call.

- "none" (or no tools): plain text; the tools still reach the chat template, as vLLM.
- "auto": the model decides; its own call format is parsed from the output by the
  server's --tool-call-parser (which needs --enable-auto-tool-choice, as vLLM).
- "required" / a named function: the output is constrained by a grammar built from the
  functions' parameter schemas, so the arguments are always valid: one or more
  `{"name": ..., "parameters": {...}}` objects separated by "; " (one when
  parallel_tool_calls is false), read back by the llama3_json parser; for a named
  function the output is its arguments object alone.

parallel_tool_calls false: at most one call is returned, the first (as vLLM, whatever the
tool choice: under "auto" the model's further calls are dropped from the answer).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from jaxserve.api.tool_parsers import ToolParser, get_tool_parser
from jaxserve.errors import InputError
from jaxserve.structured_outputs import StructuredOutputsParams

# Compact JSON inside the forced grammar: arguments come out as clients print them.
_COMPACT = {"whitespace_flexible": False}


@dataclass(frozen=True)
class ToolSetup:
    mode: str                                   # "none", "auto", "required" or "named"
    tools: list[dict] | None = None             # the request's, for the template
    name: str | None = None                     # the named function
    parser: type[ToolParser] | None = None      # how the output is read back
    parallel: bool = True                       # False: only the first call is returned

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar forcing the call(s), for "required" and named choices."""
        if self.mode == "named":
            return StructuredOutputsParams(json={**_parameters(self._function(self.name)),
                                                 "x-guidance": _COMPACT})
        if self.mode != "required":
            return None
        calls = {"anyOf": [
            {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
             "properties": {"name": {"const": f["name"]}, "parameters": _parameters(f)}}
            for f in map(_function_of, self.tools)], "x-guidance": _COMPACT}
        repeat = ' ("; " call)*' if self.parallel else ""
        return StructuredOutputsParams(grammar=f"start: call{repeat}\ncall: %json "
                                               f"{json.dumps(calls)}")

    def _function(self, name: str) -> dict:
        return next(f for f in map(_function_of, self.tools) if f["name"] == name)


def _function_of(tool: dict) -> dict:
    return tool["function"]


def _parameters(function: dict) -> dict:
    params = function.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def _check_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise InputError("tools must be a list of {'type': 'function', 'function': {...}}",
                         "tools")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not fn["name"]:
            raise InputError(f"tools[{i}] must be {{'type': 'function', 'function': "
                             f"{{'name': ..., 'parameters': {{...}}}}}}", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InputError(f"tools[{i}].function.parameters must be a JSON schema object",
                             "tools")
        if fn["name"] in names:
            raise InputError(f"tools: function {fn['name']!r} is defined twice", "tools")
        names.add(fn["name"])
    return tools


def tool_setup(tools: Any, tool_choice: Any, *, auto_parser: str | None,
               parallel: bool = True) -> ToolSetup:
    """What a request asks for; InputError naming the field for what cannot be served.
    auto_parser: the server's --tool-call-parser when --enable-auto-tool-choice is on;
    parallel: the request's parallel_tool_calls."""
    return replace(_setup(tools, tool_choice, auto_parser), parallel=parallel)


def _setup(tools: Any, tool_choice: Any, auto_parser: str | None) -> ToolSetup:
    tools = _check_tools(tools) if tools else None
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if not tools:
        if tool_choice not in ("none", "auto"):
            raise InputError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return ToolSetup("none")
    if tool_choice == "none":
        return ToolSetup("none", tools)
    if tool_choice == "auto":
        if auto_parser is None:
            raise InputError('"auto" tool choice needs the server started with '
                             '--enable-auto-tool-choice and --tool-call-parser NAME; or use '
                             'tool_choice "required" or a named function', "tool_choice")
        return ToolSetup("auto", tools, parser=get_tool_parser(auto_parser))
    if tool_choice == "required":
        return ToolSetup("required", tools, parser=get_tool_parser("llama3_json"))
    function = tool_choice.get("function") if isinstance(tool_choice, dict) \
        and tool_choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InputError("tool_choice must be 'none', 'auto', 'required' or {'type': "
                         "'function', 'function': {'name': ...}}", "tool_choice")
    if name not in {f["name"] for f in map(_function_of, tools)}:
        raise InputError(f"tool_choice names {name!r}, which is not among the tools",
                         "tool_choice")
    return ToolSetup("named", tools, name=name)
