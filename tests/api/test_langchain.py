"""LangChain's OpenAI chat model against a real server (the agent frameworks' way in):
bind_tools with a forced and an automatic choice, and with_structured_output by JSON
schema and by function calling. Random weights: only the constraints make the answers
valid."""
from __future__ import annotations

import jsonschema
import pytest
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.api.conftest import API_KEY


class Weather(BaseModel):
    """Weather forecast for a city."""
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Forecast for a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 8}}}}}


@pytest.fixture(scope="module")
def chat(tool_server):
    import openai
    model = openai.OpenAI(base_url=tool_server.url + "/v1",
                          api_key=API_KEY).models.list().data[0].id
    return ChatOpenAI(base_url=tool_server.url + "/v1", api_key=API_KEY, model=model,
                      temperature=1.0, max_tokens=80, seed=1)


def test_bind_tools(chat):
    msg = chat.bind_tools([WEATHER_TOOL], tool_choice="required").invoke("Weather in Oslo?")
    assert isinstance(msg, AIMessage) and msg.tool_calls
    for call in msg.tool_calls:       # LangChain parsed the arguments JSON itself
        assert call["name"] == "get_weather"
        jsonschema.validate(call["args"], WEATHER_TOOL["function"]["parameters"])
    named = chat.bind_tools([WEATHER_TOOL, Weather], tool_choice="Weather").invoke("Oslo?")
    assert [c["name"] for c in named.tool_calls] == ["Weather"]
    Weather.model_validate(named.tool_calls[0]["args"])
    auto = chat.bind_tools([WEATHER_TOOL]).invoke("Say hello.")   # "auto": plain text here
    assert isinstance(auto, AIMessage) and not auto.invalid_tool_calls


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(chat, method):
    answer = chat.with_structured_output(Weather, method=method).invoke("Oslo, 3 days?")
    assert isinstance(answer, Weather) and 1 <= answer.days <= 7 and len(answer.city) <= 8
