"""Constrained decoding offline, on a random-weight model at temperature 1: only the
constraint can make its output valid. JSON schema / object, regex, choice, Lark and GBNF
grammars; n > 1; preemption in the middle (the grammar state is rebuilt from the
output so far); token constraints (allowed_token_ids, logit_bias, bad_words); invalid
constraints refused at the front door; nothing compiles after warmup."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.structured_outputs import StructuredOutputsParams as SO
from tests.engine.conftest import assert_no_leaks

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person as JSON:", "hello", "x y z"]


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("qwen3"), dtype="float32", max_model_len=256, max_num_seqs=8,
               max_num_batched_tokens=64)


def generate(llm, so: SO, n: int = 1, max_tokens: int = 150, prompts=PROMPTS):
    params = [SamplingParams(temperature=1.0, seed=i, n=n, max_tokens=max_tokens,
                             structured_outputs=so) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [c for o in outs for c in o.outputs]


def test_json_schema(llm):
    before = llm.engine.num_compilations
    outs = generate(llm, SO(json=SCHEMA, disable_any_whitespace=True), n=2)
    assert len(outs) == 6
    for c in outs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
        outside_strings = re.sub(r'"(\\.|[^"\\])*"', '""', c.text)
        assert not re.search(r"\s", outside_strings), c.text      # disable_any_whitespace
    assert len({c.text for c in outs}) > 1           # sampled, not one forced answer
    assert llm.engine.num_compilations == before, "a grammar compiled a new program"
    assert_no_leaks(llm.engine)


def test_json_object_schema_as_text_and_any_whitespace(llm):
    for c in generate(llm, SO(json_object=True), max_tokens=200):
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:   # cut by max_tokens: still a valid prefix of an object
            assert c.finish_reason == "length" and c.text.lstrip().startswith("{")
    for c in generate(llm, SO(json=json.dumps(SCHEMA))):
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_regex_choice_and_grammars(llm):
    for c in generate(llm, SO(regex=r"[0-9]{3}-[a-z]{2,4}")):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", c.text) and c.finish_reason == "stop"
    choices = ["red", "green", "blue sky"]
    outs = generate(llm, SO(choice=choices), n=3)
    assert {c.text for c in outs} <= set(choices) and all(c.finish_reason == "stop" for c in outs)
    lark = 'start: term ("+" term)*\nterm: /[0-9]{1,3}/'
    gbnf = 'root ::= term ("+" term)*\nterm ::= [0-9] [0-9]? [0-9]?'
    for grammar in (lark, gbnf):
        for c in generate(llm, SO(grammar=grammar)):
            assert c.finish_reason == "stop", c.text
            assert re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3})*", c.text), c.text


def test_preemption_rebuilds_the_grammar_state(checkpoint):
    """Pages for about two of the four requests: some are preempted mid-output and
    resume (their grammar state rebuilt from the tokens they had) to valid JSON."""
    llm = LLM(checkpoint("qwen3"), dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, num_pages=9)
    prompts = [[7 + i] * 40 for i in range(4)]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=80,
                            structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert_no_leaks(llm.engine)


def test_token_constraints(llm):
    tok = llm.get_tokenizer()
    a, b = tok("a", add_special_tokens=False).input_ids[0], \
        tok("b", add_special_tokens=False).input_ids[0]
    c = tok("x", add_special_tokens=False).input_ids[0]
    free = SamplingParams(temperature=1.0, seed=0, max_tokens=60, allowed_token_ids=[a, b, c])
    out = llm.generate("hello", free, use_tqdm=False)[0].outputs[0].token_ids
    assert set(out) <= {a, b, c}
    pairs = lambda ids: sum(x == a and y == b for x, y in zip(ids, ids[1:]))  # noqa: E731
    assert pairs(out) > 0             # without bad_words "ab" does occur
    banned = SamplingParams(temperature=1.0, seed=0, max_tokens=60, allowed_token_ids=[a, b, c],
                            bad_words=["ab", "x"])
    out = llm.generate("hello", banned, use_tqdm=False)[0].outputs[0].token_ids
    assert set(out) <= {a, b} and pairs(out) == 0
    biased = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={c: 100})
    assert llm.generate("hello", biased, use_tqdm=False)[0].outputs[0].token_ids == [c] * 5


@pytest.mark.parametrize("so, match", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "nonsense"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="[a-"), "regex"),
    (dict(grammar="start: ("), "grammar|lark"),
    (dict(regex="a", choice=["b"]), "exactly one"),
])
def test_invalid_constraints_are_refused(llm, so, match):
    with pytest.raises(ValueError, match=match) as e:
        llm.generate("hi", SamplingParams(structured_outputs=SO(**so)), use_tqdm=False)
    assert getattr(e.value, "param", None) == "structured_outputs"


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    for kw, param in ((dict(allowed_token_ids=[10**6]), "allowed_token_ids"),
                      (dict(logit_bias={10**6: 1.0}), "logit_bias")):
        with pytest.raises(ValueError, match="outside the vocabulary") as e:
            llm.generate("hi", SamplingParams(**kw), use_tqdm=False)
        assert e.value.param == param
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=SO(regex="a"))


def test_grammar_applies_after_the_reasoning_ends(llm):
    """grammar_after_ids (set by the server's reasoning parser): tokens are free until the
    output ends with the marker, and from the next one on they follow the grammar. Here the
    marker is the one token of "x", made likely by a logit bias."""
    tok = llm.get_tokenizer()
    x = tok("x", add_special_tokens=False).input_ids
    assert len(x) == 1
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=150, logit_bias={x[0]: 4.0},
                             structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True),
                             grammar_after_ids=tuple(x)) for i in range(4)]
    outs = llm.generate(["think first"] * 4, params, use_tqdm=False)
    free = 0
    for o in outs:
        c = o.outputs[0]
        reasoning, _, answer = c.text.partition("x")
        free += len(reasoning)
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(answer), SCHEMA)
    assert free > 0      # some reasoning came before the marker, unconstrained


def test_constraints_the_token_constraints_rule_out_are_refused(llm):
    """The grammar's first tokens against allowed_token_ids and one-token bad_words: none
    left is a refusal, not an output that ignores one of them."""
    tok = llm.get_tokenizer()
    a, b = (tok(c, add_special_tokens=False).input_ids[0] for c in "ab")
    for kw in (dict(allowed_token_ids=[b]), dict(bad_words=["a"])):
        params = SamplingParams(max_tokens=5, structured_outputs=SO(choice=["ab"]), **kw)
        with pytest.raises(ValueError, match="no token to start with") as e:
            llm.generate("hi", params, use_tqdm=False)
        assert e.value.param == "structured_outputs"
    ok = SamplingParams(max_tokens=5, allowed_token_ids=[a, b], structured_outputs=SO(
        choice=["ab"]))
    assert llm.generate("hi", ok, use_tqdm=False)[0].outputs[0].text.startswith("ab")


def test_a_grammar_that_fails_mid_output_ends_with_error(llm, caplog):
    """allowed_token_ids leave "a" but not the "b" the choice needs next: the output
    ends with finish_reason "error" (never "stop" with text that breaks the constraint),
    logged once per request, in a bounded line."""
    tok = llm.get_tokenizer()
    a = tok("a", add_special_tokens=False).input_ids[0]
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=20, allowed_token_ids=[a],
                            structured_outputs=SO(choice=["a" + "b" * 2000]))
    with caplog.at_level("WARNING", logger="jaxserve"):
        outs = llm.generate(["hi", "there"], params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "error" and c.token_ids[0] == a and len(c.token_ids) == 2
    lines = [r.getMessage() for r in caplog.records]
    assert len([m for m in lines if "structured output failed" in m]) == 2, lines
    assert all(len(m) < 500 for m in lines), max(lines, key=len)
    assert_no_leaks(llm.engine)
