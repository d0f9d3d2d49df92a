"""Fields jaxserve knows of but does not implement are refused by name (400), never
accepted and ignored; the same fields with values that change nothing are accepted;
unknown fields are ignored and logged once (jaxserve/api/unsupported.py)."""
from __future__ import annotations

import json

import openai
import pytest
from pydantic import ValidationError

from jaxserve.api.protocol import ChatCompletionRequest, CompletionRequest
from jaxserve.api.unsupported import IGNORED, REFUSED
from tests.api.conftest import API_KEY

CHAT = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# A value of each refused field that would change the answer, and one that would not.
USED = {
    "guided_whitespace_pattern": " ",
    "tools": [TOOL], "functions": [TOOL["function"]], "function_call": "auto",
    "tool_choice": "required", "prompt_logprobs": 1, "best_of": 2, "use_beam_search": True,
    "length_penalty": 0.5, "suffix": "!",
    "return_tokens_as_token_ids": True, "chat_template": "{{ messages }}",
    "continue_final_message": True, "documents": [{"text": "x"}],
    "mm_processor_kwargs": {"a": 1}, "audio": {"voice": "x"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
    "web_search_options": {},
}
NOOP = {"tools": [], "tool_choice": "none", "function_call": "none", "best_of": 1,
        "use_beam_search": False, "length_penalty": 1.0, "suffix": "", "modalities": ["text"],
        "return_tokens_as_token_ids": False, "continue_final_message": False}


def test_every_refused_field_has_a_case():
    assert set(USED) == set(REFUSED)


@pytest.mark.parametrize("field", sorted(REFUSED))
@pytest.mark.parametrize("cls, base", [(ChatCompletionRequest, {"messages": CHAT}),
                                       (CompletionRequest, {"prompt": "hi"})],
                         ids=["chat", "completions"])
def test_refused_by_name_unless_it_changes_nothing(field, cls, base):
    if field in cls.model_fields:   # chat implements them (test_tools_api,
        assert field in ("tools", "tool_choice", "continue_final_message")   # request_fields)
        return
    with pytest.raises(ValidationError) as e:
        cls.model_validate({**base, field: USED[field]})
    err = e.value.errors()[0]
    assert err["ctx"]["field"] == field and field in err["msg"] and "not supported" in err["msg"]
    cls.model_validate({**base, field: None})
    if field in NOOP:
        cls.model_validate({**base, field: NOOP[field]})


def test_legacy_function_call_in_the_history_is_refused_and_tool_calls_pass():
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    ChatCompletionRequest.model_validate({"messages": history})
    legacy = [*CHAT, {"role": "assistant", "content": None,
                      "function_call": {"name": "get_weather", "arguments": "{}"}}]
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": legacy})
    assert e.value.errors()[0]["ctx"]["field"] == "messages.1.function_call"


def test_stream_option_not_implemented_is_refused():
    with pytest.raises(ValidationError, match="continuous_usage_stats"):
        CompletionRequest.model_validate({"prompt": "hi", "stream": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}})


def test_ignored_fields_are_not_refused():
    for field in IGNORED:
        ChatCompletionRequest.model_validate({"messages": CHAT, field: {"x": 1}})


def test_through_the_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    model = client.models.list().data[0].id
    refused = [
        ("functions", dict(extra_body={"functions": [TOOL["function"]]})),
        ("guided_whitespace_pattern", dict(extra_body={"guided_whitespace_pattern": " "})),
    ]
    for field, kwargs in refused:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, **kwargs)
        assert e.value.status_code == 400
        param = e.value.body["param"]       # the first refused field the client sent
        assert param in field.split() and param in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", max_tokens=2,
                                  extra_body={"best_of": 3})
    assert e.value.body["param"] == "best_of"
    # Values that change nothing, and unknown fields, are served.
    out = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=2,
        extra_body={"tools": [], "some_new_field": 1, "store": True})
    assert out.choices[0].finish_reason == "length"
    log = server.output()
    assert log.count("request field 'some_new_field' (unknown)") == 1
    client.chat.completions.create(model=model, messages=CHAT, max_tokens=2,
                                   extra_body={"some_new_field": 2})
    assert server.output().count("request field 'some_new_field' (unknown)") == 1
