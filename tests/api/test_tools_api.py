"""Tool calling and reasoning through the openai client against a real server started
as vLLM users start it (--enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3), on a random-weight model at temperature 1.

"required" and named tool choices are constrained by a grammar built from the tools'
schemas, so their arguments validate whatever the weights. For "auto" and reasoning, the
model's own format is forced with a grammar (structured_outputs) so that the parsers
have something real to read, streamed and not. A tool round trip in the history reaches
the chat template (a test template prints what it gets)."""
from __future__ import annotations

import json
from collections import defaultdict

import httpx
import jsonschema
import openai
import pytest

from jaxserve.api.tool_parsers.json_call import JsonScanner
from tests.api.conftest import API_KEY

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key=API_KEY)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def streamed(client, model, **kw) -> tuple[dict, dict, str]:
    """(per choice: {call index: [id, name, arguments]}, per choice content, reasoning)."""
    calls: dict = defaultdict(dict)
    content: dict = defaultdict(str)
    reasoning = ""
    finish = {}
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            content[ch.index] += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                entry = calls[ch.index].setdefault(tc.index, [None, None, ""])
                if tc.id:
                    assert entry[0] is None, "a call's id came twice"
                    entry[0] = tc.id
                if tc.function and tc.function.name:
                    entry[1] = tc.function.name
                entry[2] += (tc.function.arguments or "") if tc.function else ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    return calls, content, reasoning, finish


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_gives_valid_calls(client, model):
    out = client.chat.completions.create(model=model, messages=CHAT, tools=TOOLS, n=3,
                                         tool_choice="required", temperature=1.0, seed=1,
                                         max_tokens=100)
    # A random model may go on adding parallel calls until max_tokens: its complete calls
    # are still returned (the cut one stays content), each valid.
    assert "tool_calls" in {c.finish_reason for c in out.choices}
    for choice in out.choices:
        assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            check_call(call.function.name, call.function.arguments)
    calls, content, _, finish = streamed(client, model, messages=CHAT, tools=TOOLS,
                                         tool_choice="required", temperature=1.0, seed=2,
                                         max_tokens=100, parallel_tool_calls=False)
    assert finish[0] == "tool_calls" and len(calls[0]) == 1 and not content[0].strip()
    call_id, name, arguments = calls[0][0]
    assert call_id and name in SCHEMAS
    check_call(name, arguments)


def test_named_function(client, model):
    choice = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model=model, messages=CHAT, tools=TOOLS,
                                         tool_choice=choice, temperature=1.0, seed=3,
                                         max_tokens=60)
    msg = out.choices[0].message
    assert msg.content is None and out.choices[0].finish_reason == "stop"
    assert [c.function.name for c in msg.tool_calls] == ["get_time"]
    check_call("get_time", msg.tool_calls[0].function.arguments)
    calls, _, _, _ = streamed(client, model, messages=CHAT, tools=TOOLS, tool_choice=choice,
                              temperature=1.0, seed=4, max_tokens=60)
    assert calls[0][0][1] == "get_time"
    check_call("get_time", calls[0][0][2])


# The model's own hermes format, forced so that "auto" has calls to find, after a think
# block the reasoning parser splits off.
HERMES = ('start: "<think>" /[a-z ]{1,20}/ "</think>" "Sure. " call\n'
          'call: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " args '
          '"}\\n</tool_call>"\n'
          'args: %json ' + json.dumps({**WEATHER, "x-guidance": {"whitespace_flexible": False}}))


def test_auto_parses_the_models_own_format_and_reasoning(client, model):
    kw = dict(messages=CHAT, tools=TOOLS, temperature=1.0, seed=5, max_tokens=100,
              extra_body={"structured_outputs": {"grammar": HERMES}})
    out = client.chat.completions.create(model=model, **kw)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Sure." and msg.reasoning_content
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    check_call("get_weather", msg.tool_calls[0].function.arguments)
    calls, content, reasoning, finish = streamed(client, model, **kw)
    assert finish[0] == "tool_calls" and content[0].strip() == "Sure." and reasoning
    assert calls[0][0][1] == "get_weather"
    check_call("get_weather", calls[0][0][2])


def test_plain_text_under_auto_has_no_calls(client, model):
    out = client.chat.completions.create(model=model, messages=CHAT, tools=TOOLS,
                                         temperature=1.0, seed=6, max_tokens=20)
    assert out.choices[0].finish_reason == "length" and not out.choices[0].message.tool_calls


def test_a_tool_round_trip_reaches_the_template(tool_server):
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    ids = httpx.post(tool_server.url + "/tokenize", headers=auth,
                     json={"messages": history, "tools": TOOLS}).json()["tokens"]
    text = httpx.post(tool_server.url + "/detokenize", headers=auth,
                      json={"tokens": ids}).json()["prompt"]
    assert "TOOLS:get_weather;get_time;" in text
    assert "[call get_weather Paris]" in text          # arguments reached it as an object
    assert "(id call_1)" in text and "<tool>sunny" in text
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key=API_KEY)
    out = client.chat.completions.create(model=client.models.list().data[0].id,
                                         messages=history, tools=TOOLS, max_tokens=3)
    assert out.usage.prompt_tokens == len(ids)        # the chat rendered the same prompt


@pytest.mark.parametrize("kw, param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", extra_body={"ignore_eos": True}), "tool_choice"),
])
def test_bad_tool_requests_are_refused_by_name(client, model, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_auto_needs_the_server_flag(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=client.models.list().data[0].id, messages=CHAT,
                                       tools=TOOLS, max_tokens=5)
    assert e.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in \
        e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:   # completions have no tools
        client.completions.create(model=client.models.list().data[0].id, prompt="hi",
                                  max_tokens=2, extra_body={"tools": TOOLS})
    assert e.value.body["param"] == "tools"


def test_structured_output_waits_for_the_think_block(client, model):
    """With --reasoning-parser, when the template opened a think block the grammar waits
    for its end: the first tokens are free reasoning (here never closed: all of it is
    reasoning_content); without the block the answer is JSON from its first token."""
    kw = dict(model=model, messages=CHAT, temperature=1.0, seed=10, max_tokens=12,
              response_format={"type": "json_object"})
    thinking = client.chat.completions.create(
        extra_body={"chat_template_kwargs": {"think": True}}, **kw).choices[0].message
    assert thinking.reasoning_content and thinking.content is None
    scanner = JsonScanner()                 # not the grammar's: not even a JSON prefix
    scanner.feed(thinking.reasoning_content.lstrip())
    assert scanner.error, thinking.reasoning_content
    plain = client.chat.completions.create(**kw).choices[0].message
    assert plain.content.lstrip().startswith("{")
    assert getattr(plain, "reasoning_content", None) is None


# Two calls in the model's own format, so that "auto" finds both.
TWO_CALLS = HERMES.replace('"Sure. " call\n', '"Sure. " call call\n')


def test_parallel_tool_calls_false_keeps_the_first_call_under_auto(client, model):
    kw = dict(messages=CHAT, tools=TOOLS, temperature=1.0, seed=11, max_tokens=250,
              extra_body={"structured_outputs": {"grammar": TWO_CALLS}})
    both = client.chat.completions.create(model=model, **kw).choices[0]
    assert both.finish_reason == "tool_calls" and len(both.message.tool_calls) == 2
    first = both.message.tool_calls[0].function.arguments
    one = client.chat.completions.create(model=model, parallel_tool_calls=False,
                                         **kw).choices[0]
    assert one.finish_reason == "tool_calls" and one.message.content == "Sure."
    assert [c.function.arguments for c in one.message.tool_calls] == [first]
    calls, content, _, finish = streamed(client, model, parallel_tool_calls=False, **kw)
    assert finish[0] == "tool_calls" and content[0].strip() == "Sure."
    assert list(calls[0]) == [0] and calls[0][0][1:] == ["get_weather", first]


def test_a_tool_schema_that_overflowed_the_compiler_is_refused(client, model, tool_server):
    """A named tool whose parameters chain 3,000 $refs (the grammar forcing its call
    overflowed the compiler's native stack: the server died): a 400 naming the tools and
    the limit; the server goes on."""
    defs = {f"{i:x}": {"$ref": f"#/$defs/{i + 1:x}"} for i in range(3000)}
    defs[f"{3000:x}"] = {"type": "integer"}
    deep = [{"type": "function", "function": {
        "name": "deep", "parameters": {"$ref": "#/$defs/0", "$defs": defs}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, tools=deep,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "deep"}})
    assert e.value.body["param"] == "tools" and "the limit is" in e.value.body["message"]
    assert httpx.get(tool_server.url + "/health").status_code == 200
