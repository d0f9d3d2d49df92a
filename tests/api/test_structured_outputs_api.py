"""Structured outputs and token constraints through the openai client against a real
server, on a random-weight model at temperature 1 (only the constraint makes its output
valid): OpenAI's response_format, vLLM's structured_outputs and guided_* fields, streamed
and not; logit_bias, allowed_token_ids, bad_words; refusals name their field."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from jaxserve.api.tool_parsers.json_call import JsonScanner
from tests.api.conftest import API_KEY

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
          "properties": {"city": {"type": "string", "maxLength": 10},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14}}}
CHAT = [{"role": "user", "content": "Plan a trip as JSON."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def streamed_chat(client, model, **kw) -> str:
    chunks = client.chat.completions.create(model=model, messages=CHAT, stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_response_format_json_schema_and_object(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    out = client.chat.completions.create(model=model, messages=CHAT, temperature=1.0, seed=1,
                                         n=3, max_tokens=90, response_format=fmt)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    text = streamed_chat(client, model, temperature=1.0, seed=2, max_tokens=90,
                         response_format=fmt)
    jsonschema.validate(json.loads(text), SCHEMA)
    out = client.chat.completions.create(model=model, messages=CHAT, temperature=1.0, seed=3,
                                         max_tokens=90, response_format={"type": "json_object"})
    text = out.choices[0].message.content
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:          # cut by max_tokens: still the start of an object
        scanner = JsonScanner()
        assert out.choices[0].finish_reason == "length" and text.lstrip().startswith("{")
        scanner.feed(text.lstrip())
        assert not scanner.error, text


@pytest.mark.parametrize("body, check", [
    ({"structured_outputs": {"regex": "[0-9]{2}:[0-9]{2}"}},
     lambda t: re.fullmatch(r"[0-9]{2}:[0-9]{2}", t)),
    ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"guided_regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_grammar": 'root ::= "a" "b"* "c"'}, lambda t: re.fullmatch("ab*c", t)),
])
@pytest.mark.parametrize("stream", [False, True])
def test_vllm_fields_on_completions(client, model, body, check, stream):
    kw = dict(model=model, prompt="Answer:", temperature=1.0, seed=5, max_tokens=60,
              extra_body=body)
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                       if c.choices)
    else:
        text = client.completions.create(**kw).choices[0].text
    assert check(text), text


def test_token_constraints(client, model, api_checkpoint):
    tok = AutoTokenizer.from_pretrained(api_checkpoint)
    x = tok("x", add_special_tokens=False).input_ids[0]
    out = client.completions.create(model=model, prompt="hi", temperature=0.0, max_tokens=4,
                                    logit_bias={str(x): 100})
    assert out.choices[0].text == tok.decode([x] * 4)
    ids = [tok(c, add_special_tokens=False).input_ids[0] for c in "abc"]
    out = client.completions.create(model=model, prompt="hi", temperature=1.0, seed=0,
                                    max_tokens=40, extra_body={"allowed_token_ids": ids,
                                                               "bad_words": ["c"]})
    assert set(out.choices[0].text) <= {"a", "b"} and out.choices[0].text


@pytest.mark.parametrize("kw, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}),
     "response_format"),
    (dict(extra_body={"structured_outputs": {"regex": "[a-"}}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}),
     "structured_outputs"),
    (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "guided_choice"),
    (dict(extra_body={"structured_outputs": {"jsn": {}}}), "structured_outputs"),
    (dict(response_format={"type": "structural_tag"}), "response_format"),
    (dict(extra_body={"guided_decoding_backend": "xgrammar"}), "guided_decoding_backend"),
    (dict(extra_body={"allowed_token_ids": [10**6]}), "allowed_token_ids"),
    (dict(logit_bias={"5": 1.0, "x": 2.0}), "logit_bias"),
    (dict(extra_body={"bad_words": ["x"] * 16385}), "bad_words"),     # MAX_BAD_WORDS
    (dict(extra_body={"bad_words": ["y" * 300]}), "bad_words"),       # tokens in a word
])
def test_bad_constraints_are_refused_by_name(client, model, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_constraints_no_output_can_meet_are_refused(client, model, api_checkpoint):
    """A $ref cycle with no way out, a grammar with no base case, a choice the token
    constraints rule out from its first token: 400s, where they were 200s whose output
    broke the constraint with finish_reason "stop"."""
    tok = AutoTokenizer.from_pretrained(api_checkpoint)
    b = tok("b", add_special_tokens=False).input_ids[0]
    cycle = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"},
                                            "b": {"$ref": "#/$defs/a"}}}
    for body, param in (({"guided_json": cycle}, "guided_json"),
                        ({"guided_grammar": 'start: "x" start'}, "guided_grammar"),
                        ({"guided_choice": ["ab"], "allowed_token_ids": [b]}, "guided_choice"),
                        ({"guided_choice": ["ab"], "bad_words": ["a"]}, "guided_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="hi", max_tokens=5, extra_body=body)
        assert e.value.body["param"] == param, (body, e.value.body)


def finished_with_error(server) -> float:
    """vllm:request_success_total{finished_reason="error"}"""
    metrics = httpx.get(server.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:request_success_total{")
               and 'finished_reason="error"' in line)


def test_a_constraint_that_fails_mid_output_finishes_with_error(client, model, server,
                                                                 api_checkpoint):
    """The token constraints leave the choice's first token but not its second: the
    choice ends with finish_reason "error", streamed or not, and counts as one."""
    tok = AutoTokenizer.from_pretrained(api_checkpoint)
    a = tok("a", add_special_tokens=False).input_ids[0]
    body = {"guided_choice": ["ab"], "allowed_token_ids": [a]}
    before = finished_with_error(server)
    out = client.completions.create(model=model, prompt="hi", max_tokens=8, temperature=1.0,
                                    seed=1, extra_body=body)
    assert out.choices[0].finish_reason == "error" and out.choices[0].text.startswith("a")
    chunks = list(client.completions.create(model=model, prompt="hi", max_tokens=8,
                                            stream=True, extra_body=body))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "error"
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8,
                                          extra_body=body)
    assert chat.choices[0].finish_reason == "error"
    assert finished_with_error(server) == before + 3


def test_deep_grammars_compile_off_the_crashing_stack(client, model):
    """4,000 chained Lark rules overflowed the compiler's stack (the server died)."""
    grammar = "start: r0\n" + "".join(f"r{i:x}: r{i + 1:x}\n" for i in range(4000)) + \
        'r{:x}: "ok"\n'.format(4000)
    out = client.completions.create(model=model, prompt="hi", max_tokens=4,
                                    extra_body={"guided_grammar": grammar})
    assert out.choices[0].text == "ok" and out.choices[0].finish_reason == "stop"


def test_the_request_log_line_is_bounded():
    """The server logs each request's sampling fields: never a megabyte grammar or stop
    string whole (a client's grammar was logged in full, per token, by the matcher too)."""
    from jaxserve.api.log_values import DEFAULT_MAX_LOG_LEN, loggable
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.structured_outputs import StructuredOutputsParams
    params = SamplingParams(max_tokens=7, stop=["x" * 10**5], bad_words=["y" * 10**5],
                            structured_outputs=StructuredOutputsParams(grammar="z" * 10**6))
    line = loggable(params, DEFAULT_MAX_LOG_LEN)
    assert "max_tokens=7" in line and "zzzzzzzzzz" not in line, line
    assert "grammar=<1000000 chars>" in line and "x" * (DEFAULT_MAX_LOG_LEN + 1) not in line
    assert len(line) < 60 * DEFAULT_MAX_LOG_LEN, len(line)
