"""Tool-call parsers (jaxserve.api.tool_parsers) on hand-written outputs in each format:
whole-text extract(), the same text streamed in random chunks (1-character chunks
included) adding up to exactly extract()'s result, and malformed outputs coming back as
content without raising. Pure Python: no jax, no server."""
from __future__ import annotations

import json
import random
import re

import pytest

from jaxserve.api.tool_parsers import (TOOL_PARSERS, DeltaMessage, ToolParser,
                                       get_tool_parser)
from jaxserve.api.tool_parsers.qwen3_coder import convert

SEEDS = [0, 1, 2, 3, 4, 5]           # seed 0: one character at a time

def _fn(name: str, **props: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in props.items()}}}}

TOOLS = [_fn("get_weather", city="string", days="integer", hourly="boolean"),
         _fn("run_sql", query="string", params="array", options="object"),
         _fn("set_temperature", value="number")]

# (parser, id, output, expected content, expected calls as (name, arguments object))
CASES = [
    ("hermes", "qwen3-two-calls",
     "I'll check the weather in both cities for you.\n\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
     "</tool_call>\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "東京", "unit": "celsius"}}\n</tool_call>',
     "I'll check the weather in both cities for you.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}),
      ("get_weather", {"city": "東京", "unit": "celsius"})]),
    ("hermes", "nested-and-tricky-strings",
     '<tool_call>\n{"name": "run_python", "arguments": {"code": '
     r'"def f(x):\n    return {\"k\": [x, ' r"'}']}  # </tool_call>\n" '", "timeout": 30, '
     '"env": {"PATH": "/usr/bin", "flags": [true, false, null, -1.5e3]}}}\n</tool_call>',
     None,
     [("run_python", {"code": 'def f(x):\n    return {"k": [x, \'}\']}  # </tool_call>\n',
                      "timeout": 30,
                      "env": {"PATH": "/usr/bin", "flags": [True, False, None, -1500.0]}})]),
    ("hermes", "compact-then-text",
     '<tool_call>{"name":"search","arguments":{"query":"emoji 🚀 and \\u00e9"}}</tool_call>'
     "\nSearching now.",
     "Searching now.", [("search", {"query": "emoji 🚀 and é"})]),
    ("hermes", "key-order-aliases-text-between",
     'Let me do three things.\n<tool_call>\n{"arguments": {"path": "/tmp/a b"}, '
     '"name": "list_dir"}\n</tool_call>\nThen:\n<tool_call>\n{"name": "get_time"}\n'
     '</tool_call>\n<tool_call>\n{"name": "echo", "parameters": {"text": "a\\tb"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "calc", "arguments": "{\\"expr\\": \\"1+1\\"}"}\n'
     "</tool_call>\n",
     "Let me do three things.\n\nThen:",
     [("list_dir", {"path": "/tmp/a b"}), ("get_time", {}), ("echo", {"text": "a\tb"}),
      ("calc", {"expr": "1+1"})]),
    ("hermes", "lookalike-tags-are-content",
     'Use <tool_call> tags like <tool_call>this</tool_call>, or write "<tool_" in text.',
     'Use <tool_call> tags like <tool_call>this</tool_call>, or write "<tool_" in text.', []),
    ("hermes", "no-calls-kept-exactly", "The capital of France is Paris.\n",
     "The capital of France is Paris.\n", []),
    ("llama3_json", "one-call",
     '{"name": "get_weather", "parameters": {"city": "San Francisco, CA", '
     '"unit": "fahrenheit"}}', None,
     [("get_weather", {"city": "San Francisco, CA", "unit": "fahrenheit"})]),
    ("llama3_json", "python-tag-quotes-braces",
     '<|python_tag|>{"name": "search", "parameters": {"query": '
     '"café \\"quoted\\" {braces}; semicolons"}}', None,
     [("search", {"query": 'café "quoted" {braces}; semicolons'})]),
    ("llama3_json", "two-calls",
     '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": '
     '{"y": [1, 2, {"z": null}]}}', None,
     [("a", {"x": 1}), ("b", {"y": [1, 2, {"z": None}]})]),
    ("llama3_json", "whitespace-around", '\n\n{"name": "ping", "parameters": {}}\n', None,
     [("ping", {})]),
    ("llama3_json", "plain-answer", "It is 21°C and sunny in Paris today.",
     "It is 21°C and sunny in Paris today.", []),
    ("llama3_json", "json-answer-not-a-call", '{"answer": 42, "unit": "none"}',
     '{"answer": 42, "unit": "none"}', []),
    ("llama3_json", "text-first-is-content", 'Sure! {"name": "a", "parameters": {}}',
     'Sure! {"name": "a", "parameters": {}}', []),
    ("llama3_json", "junk-after-separator",
     '{"name": "a", "parameters": {}}; nonsense', "; nonsense", [("a", {})]),
    ("qwen3_coder", "brief-example",
     "Let me check the forecast.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     "Let me check the forecast.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("qwen3_coder", "multiline-code-and-types",
     "<tool_call>\n<function=run_sql>\n<parameter=query>\nSELECT name, \"total\" FROM orders\n"
     "WHERE amount > 100 AND note <> '{x}'\n-- ünïcödé ✓\n</parameter>\n"
     "<parameter=params>\n[1, \"two\", {\"three\": 3}]\n</parameter>\n<parameter=options>\n"
     "{\"timeout\": 5, \"readonly\": true}\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=set_temperature>\n<parameter=value>\n21.5\n</parameter>\n"
     "</function>\n</tool_call>", None,
     [("run_sql", {"query": "SELECT name, \"total\" FROM orders\nWHERE amount > 100 AND "
                            "note <> '{x}'\n-- ünïcödé ✓",
                   "params": [1, "two", {"three": 3}],
                   "options": {"timeout": 5, "readonly": True}}),
      ("set_temperature", {"value": 21.5})]),
    ("qwen3_coder", "lenient-and-untyped",
     "<tool_call>\n<function=get_weather>\n<parameter=city>Berlin</parameter>\n"
     "<parameter=days>\nthree\n<parameter=hourly>\nTrue\n</parameter>\n</function>\n"
     "</tool_call>\n<tool_call>\n<function=notes.append>\n<parameter=text>\n\nline one\n"
     "line two\n\n</parameter>\n<parameter=count>\n2\n</parameter>\n<parameter=tags>\n"
     "[\"a\", \"b\"]\n</parameter>\n</function>\n</tool_call>", None,
     [("get_weather", {"city": "Berlin", "days": "three", "hourly": True}),
      ("notes.append", {"text": "\nline one\nline two\n", "count": 2, "tags": ["a", "b"]})]),
    ("qwen3_coder", "no-params-then-text",
     "<tool_call>\n<function=list_files>\n</function>\n</tool_call>\nI listed the files.",
     "I listed the files.", [("list_files", {})]),
    ("qwen3_coder", "two-functions-one-block",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
     "</function>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
     "</tool_call>", None,
     [("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Oslo"})]),
    ("gemma4", "content-then-call",
     'I will look that up.<|tool_call>call:get_current_temperature{location:<|"|>London'
     '<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>', "I will look that up.",
     [("get_current_temperature", {"location": "London", "unit": "celsius"})]),
    ("gemma4", "nested-and-back-to-back",
     '<|tool_call>call:create_event{attendees:[<|"|>ana@example.com<|"|>,<|"|>bo@example.com'
     '<|"|>],details:{floor:3,room:<|"|>B-2 {north}<|"|>},duration:1.5,notes:null,'
     'private:false}<tool_call|><|tool_call>call:get_time{}<tool_call|>', None,
     [("create_event", {"attendees": ["ana@example.com", "bo@example.com"],
                        "details": {"floor": 3, "room": "B-2 {north}"}, "duration": 1.5,
                        "notes": None, "private": False}),
      ("get_time", {})]),
    ("gemma4", "tricky-string-then-text",
     '<|tool_call>call:write_file{content:<|"|>He said "hi"\n{not: json}, [ok] – ünïcödé 🚀'
     '\\path<|"|>,path:<|"|>notes/a.txt<|"|>}<tool_call|>Done.', "Done.",
     [("write_file", {"content": 'He said "hi"\n{not: json}, [ok] – ünïcödé 🚀\\path',
                      "path": "notes/a.txt"})]),
    ("gemma4", "quoted-keys-python-values",
     '<|tool_call>call:configure{<|"|>mode<|"|>:<|"|>fast<|"|>, verbose:True, limit:None, '
     'ratio:-0.25}<tool_call|>', None,
     [("configure", {"mode": "fast", "verbose": True, "limit": None, "ratio": -0.25})]),
    ("gemma4", "lookalikes-are-content",
     "Use <|tool_call> tokens? No: <|tool_call>oops<tool_call|> is not a call.",
     "Use <|tool_call> tokens? No: <|tool_call>oops<tool_call|> is not a call.", []),
]

# (parser, id, output, whether a stream announces the call before the problem shows)
MALFORMED = [
    ("hermes", "unterminated", '<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Par', True),
    ("hermes", "invalid-json", '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n'
     "</tool_call>", True),
    ("hermes", "arguments-not-object", '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n'
     "</tool_call>", True),
    ("hermes", "missing-name", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', False),
    ("hermes", "name-not-string", '<tool_call>\n{"name": ["f"], "arguments": {}}\n'
     "</tool_call>", False),
    ("hermes", "not-json", '<tool_call>\nget_weather(city="Paris")\n</tool_call>', False),
    ("llama3_json", "unterminated", '{"name": "get_weather", "parameters": {"city": "Pa',
     True),
    ("llama3_json", "python-tag-code",
     '<|python_tag|>brave_search.call(query="weather in Paris")', False),
    ("llama3_json", "missing-name", '{"parameters": {"city": "Paris"}}', False),
    ("qwen3_coder", "unterminated", "<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nPar", True),
    ("qwen3_coder", "not-a-function", "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
     False),
    ("qwen3_coder", "name-without-bracket", "<tool_call>\n<function=get_weather\n"
     "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", False),
    ("qwen3_coder", "junk-between-params", "<tool_call>\n<function=get_weather>\nhello\n"
     "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>", True),
    ("gemma4", "unterminated", '<|tool_call>call:get_weather{location:<|"|>Lon', True),
    ("gemma4", "empty-value", "<|tool_call>call:f{a:,b:1}<tool_call|>", True),
    ("gemma4", "no-call-keyword", "<|tool_call>get_weather{a:1}<tool_call|>", False),
    ("gemma4", "missing-brace", "<|tool_call>call:f{a:1<tool_call|>", True),
]


def stream(parser: ToolParser, text: str, seed: int) -> tuple[str, list[list[str]]]:
    """Feed `text` in chunks; return the content and [id, name, arguments] per call,
    checking that id and name come exactly once, in the first piece of each call."""
    rnd = random.Random(seed)
    content: list[str] = []
    calls: list[list[str]] = []

    def take(msg: DeltaMessage) -> None:
        assert isinstance(msg, DeltaMessage)
        content.append(msg.content)
        for d in msg.tool_calls:
            if d.index == len(calls):
                assert d.id and d.name
                calls.append([d.id, d.name, d.arguments])
            else:
                assert d.index == len(calls) - 1 and d.id is None and d.name is None
                calls[-1][2] += d.arguments

    i = 0
    while i < len(text):
        n = 1 if seed == 0 else rnd.randint(1, 12)
        take(parser.feed(text[i:i + n]))
        i += n
    take(parser.finish())
    return "".join(content), calls


def _ids(cases: list) -> list[str]:
    return [f"{c[0]}:{c[1]}" for c in cases]


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_extract(case: tuple) -> None:
    name, _, text, content, calls = case
    got = get_tool_parser(name)(TOOLS).extract(text)
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls
    for c in got.tool_calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", c.id)
    assert len({c.id for c in got.tool_calls}) == len(got.tool_calls)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_stream_equals_extract(case: tuple, seed: int) -> None:
    name, _, text, _, _ = case
    cls = get_tool_parser(name)
    whole = cls(TOOLS).extract(text)
    content, calls = stream(cls(TOOLS), text, seed)
    assert (content if content.strip() else None) == whole.content
    assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in whole.tool_calls]


@pytest.mark.parametrize("case", MALFORMED, ids=_ids(MALFORMED))
def test_malformed_is_content(case: tuple) -> None:
    name, _, text, announced = case
    cls = get_tool_parser(name)
    got = cls(TOOLS).extract(text)
    assert got.tool_calls == [] and got.content == text
    for seed in SEEDS:
        content, calls = stream(cls(TOOLS), text, seed)
        if not announced:                 # nothing went out early: identical to extract
            assert calls == [] and content == text
        else:                             # the rest of the text came back as content
            assert len(calls) <= 1 and text.endswith(content)


def test_call_after_broken_call_still_parsed() -> None:
    text = ('<tool_call>\n{"name": "b", "arguments": {"x": }}\n</tool_call>\n'
            '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>')
    got = get_tool_parser("hermes")().extract(text)
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("a", "{}")]
    assert got.content == '<tool_call>\n{"name": "b", "arguments": {"x": }}\n</tool_call>'


@pytest.mark.parametrize("name,text,before", [
    ("hermes", '<tool_call>\n{"name": "say", "arguments": {"text": "The quick brown fox '
     'jumps over the lazy dog", "n": 12345}}\n</tool_call>', "}}\n"),
    ("llama3_json", '{"name": "say", "parameters": {"text": "The quick brown fox jumps '
     'over the lazy dog", "n": 12345}}', "}}"),
    ("qwen3_coder", "<tool_call>\n<function=run_sql>\n<parameter=query>\nThe quick brown fox "
     "jumps over the lazy dog\n</parameter>\n</function>\n</tool_call>", "\n</parameter>"),
    ("gemma4", '<|tool_call>call:say{text:<|"|>The quick brown fox jumps over the lazy dog'
     '<|"|>,n:12345}<tool_call|>', '<|"|>,n'),
])
def test_arguments_stream_while_generated(name: str, text: str, before: str) -> None:
    """Argument text goes out as it arrives, not only when the call closes, and only text
    that stays in the final arguments."""
    parser = get_tool_parser(name)(TOOLS)
    cut = text.index(before)
    args = ""
    for ch in text[:cut]:
        for d in parser.feed(ch).tool_calls:
            args += d.arguments
    final = get_tool_parser(name)(TOOLS).extract(text).tool_calls[0].arguments
    assert "lazy do" in args and final.startswith(args)
    assert "12345" not in args            # a number may still grow: held back


def test_exact_argument_text() -> None:
    """JSON formats keep the model's own text; the others are written as json.dumps does."""
    cases = [(c[0], c[2]) for c in CASES if c[1] in
             ("qwen3-two-calls", "brief-example", "content-then-call")]
    got = [get_tool_parser(n)(TOOLS).extract(t).tool_calls[0].arguments for n, t in cases]
    assert got == ['{"city": "Paris", "unit": "celsius"}', '{"city": "Paris", "days": 3}',
                   '{"location": "London", "unit": "celsius"}']


def test_partial_tag_is_held_back_not_leaked() -> None:
    parser = get_tool_parser("hermes")()
    assert parser.feed("Sure <tool_ca").content == "Sure"
    msg = parser.feed('ll>{"name": "f", "arguments": {}}')
    assert msg.content == "" and msg.tool_calls[0].name == "f"
    parser = get_tool_parser("hermes")()
    assert parser.feed("a <tool_ca").content == "a"
    assert parser.feed("t> b").content == " <tool_cat> b"


def test_extract_leaves_stream_state_alone() -> None:
    parser = get_tool_parser("qwen3_coder")(TOOLS)
    parser.feed("Hi <tool_call>\n<function=get_weather>\n<parameter=city>\nPa")
    assert parser.extract("plain").content == "plain"
    parser.feed("ris\n</parameter>\n</function>\n</tool_call>")
    assert parser.finish().content == ""


def test_qwen3_coder_value_conversion() -> None:
    assert convert("42", "integer") == "42" and convert("4.0", "integer") == "4"
    assert convert("x", "integer") == '"x"' and convert("2.5", "number") == "2.5"
    assert convert("FALSE", "boolean") == "false" and convert("yes", "boolean") == '"yes"'
    assert convert("{'a': 1}", "container") == '{"a": 1}'
    assert convert("[1, 2", "container") == '"[1, 2"' and convert("null", "integer") == "null"
    assert convert("NaN", "unknown") == '"NaN"' and convert("Paris", "unknown") == '"Paris"'
    assert convert("007", "unknown") == '"007"' and convert(" 7 ", "unknown") == "7"


def test_qwen3_coder_without_tools_guesses_types() -> None:
    text = CASES[14][2]
    got = get_tool_parser("qwen3_coder")().extract(text).tool_calls[0]
    assert got.arguments == '{"city": "Paris", "days": 3}'


def test_registry() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "qwen3_coder", "llama3_json", "gemma4"}
    for name, cls in TOOL_PARSERS.items():
        assert get_tool_parser(name) is cls and cls.name == name
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("mistral")


# ---- generated outputs: random calls and content, rendered in each format ---------------
_CHARS = 'ab Z:,;"\'\\{}[]<>/\n\té東🚀'
_TEXTS = ["Sure.", "Let me check {this} [x].", "a < b > c", "<tool_", "<|tool_ca", "</tool_call>",
          "<function=x> is a tag", "émoji 🚀 and \\n", "Result: {\"ok\": true}"]
_KINDS = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
          dict: "object", type(None): "null"}


def _value(rnd: random.Random, depth: int) -> object:
    k = rnd.randint(0, 5 if depth < 2 else 2)
    if k == 0:
        return "".join(rnd.choice(_CHARS) for _ in range(rnd.randint(0, 12)))
    if k == 1:
        return rnd.choice([0, -7, 10**12, 0.5, -2.25e-7, True, False, None])
    if k == 2:
        return "".join(rnd.choice(_CHARS) for _ in range(rnd.randint(0, 4)))
    if k == 3:
        return [_value(rnd, depth + 1) for _ in range(rnd.randint(0, 3))]
    return _args(rnd, depth + 1)


def _args(rnd: random.Random, depth: int = 0) -> dict:
    keys = rnd.sample(["city", "n", "flag", "opts", "items", "x_1", "ratio"], rnd.randint(0, 4))
    return {k: _value(rnd, depth) for k in keys}


def _gemma(v: object) -> str:
    if isinstance(v, str):
        return '<|"|>' + v + '<|"|>'
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_gemma(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_gemma(x) for x in v) + "]"
    return str(v)


def _render(name: str, fn: str, args: dict) -> str:
    if name == "hermes":
        return "<tool_call>\n" + json.dumps({"name": fn, "arguments": args}) + "\n</tool_call>"
    if name == "llama3_json":
        return json.dumps({"name": fn, "parameters": args}, ensure_ascii=False)
    if name == "gemma4":
        return f"<|tool_call>call:{fn}{_gemma(args)}<tool_call|>"
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n"
                     "</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={fn}>\n{params}</function>\n</tool_call>"


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_generated_outputs(name: str) -> None:
    rnd = random.Random(name)
    for _ in range(60):
        items: list[object] = []
        calls, tools = [], []
        for i in range(rnd.randint(1, 5)):
            if name != "llama3_json" and rnd.random() < 0.4:
                items.append(rnd.choice(_TEXTS))
            else:
                fn, args = f"fn_{i}", _args(rnd)
                calls.append((fn, args))
                tools.append(_fn(fn, **{k: _KINDS[type(v)] for k, v in args.items()}))
                items.append(_render(name, fn, args))
        sep = "; " if name == "llama3_json" else "\n"
        text = sep.join(x for x in items)
        content = "\n".join("" if x.startswith(("<tool_call>\n", "<|tool_call>call:"))
                            else x for x in items if name != "llama3_json")
        content = content.strip() if calls else content
        whole = get_tool_parser(name)(tools).extract(text)
        assert whole.content == (content or None), text
        assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls, text
        for seed in (0, rnd.randint(1, 10**6)):
            got, streamed = stream(get_tool_parser(name)(tools), text, seed)
            assert (got if got.strip() else None) == whole.content
            assert [(n, a) for _, n, a in streamed] == \
                [(c.name, c.arguments) for c in whole.tool_calls]
