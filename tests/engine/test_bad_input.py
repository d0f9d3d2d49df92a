"""Bad input fails fast with a ValueError naming the problem; nothing else is harmed."""
from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks


@pytest.fixture(scope="module")
def llm(checkpoint):
    # Refusals and outputs only: no warmup, a program compiles when a step first needs it.
    return LLM(checkpoint("llama"), dtype="float32", max_model_len=64, max_num_seqs=4,
               max_num_batched_tokens=32, enforce_eager=True)


OK = {"prompt_token_ids": [5, 6, 7]}


@pytest.mark.parametrize("prompt, params, message", [
    ({"prompt_token_ids": list(range(3, 70))}, SamplingParams(), "max_model_len"),
    ({"prompt_token_ids": [5] * 60}, SamplingParams(max_tokens=10), "max_tokens=10 cannot fit"),
    ({"prompt_token_ids": []}, SamplingParams(), "empty"),
    ("", SamplingParams(), "empty"),
    ({"prompt_token_ids": [5, 256]}, SamplingParams(), "token id 256 is outside"),
    ({"prompt_token_ids": [5, -1]}, SamplingParams(), "token id -1 is outside"),
    ({"prompt_token_ids": ["a"]}, SamplingParams(), "list of ints"),
    (42, SamplingParams(), "must be a str, a TextPrompt or a TokensPrompt"),
    ({"prompt_token_ids": [5], "multi_modal_data": {"audio": [1]}}, SamplingParams(),
     "multi_modal_data\\['audio'\\] is not taken"),
    ({"prompt_token_ids": [5], "multi_modal_data": {"image": [1]}}, SamplingParams(),
     "takes text only"),
    ({"prompt_token_ids": [5], "promt": "x"}, SamplingParams(), "'promt' is not one"),
    ({"prompt": ["a"]}, SamplingParams(), "'prompt' must be a str"),
    (OK, SamplingParams(logprobs=21), "logprobs=21 is more than .* max_logprobs=20"),
    (OK, SamplingParams(prompt_logprobs=30), "prompt_logprobs=30 is more than"),
    ({"prompt_token_ids": [5, 2**40]}, SamplingParams(), "outside the vocabulary"),
    ({"prompt_token_ids": [5, True]}, SamplingParams(), "list of ints"),
    (OK, SamplingParams(stop_token_ids=[256]), "stop_token_ids: 256 is outside"),
    ("a\ud800b", SamplingParams(), "not valid Unicode"),
    ("word " * 10_000, SamplingParams(), "characters"),
])
def test_bad_request_raises_and_harms_nothing(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([OK, prompt], params, use_tqdm=False)
    assert_no_leaks(llm.engine)
    # The engine still serves.
    out = llm.generate(OK, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(n=0), "n must be"),
    (dict(min_p=2.0), "min_p"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=-1), "logprobs"),
])
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_count_must_match(llm):
    with pytest.raises(ValueError, match="SamplingParams for 2 prompts"):
        llm.generate([OK, OK], [SamplingParams()] * 3, use_tqdm=False)


def test_bad_model_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported.*LlamaForCausalLM"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="float8"), "dtype"),
    (dict(page_size=12), "page_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(mesh="2y4"), "mesh"),
    (dict(max_model_len=10_000), "max_position_embeddings"),
    (dict(num_pages=3, max_model_len=64), "fewer than one sequence"),
])
def test_bad_engine_arguments(checkpoint, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(checkpoint("llama"), **{"max_num_batched_tokens": 32, "max_num_seqs": 4, **kwargs})


@pytest.mark.parametrize("kwargs, message", [
    (dict(chat_template_kwargs={"tokenize": False}), "may not set tokenize"),
    (dict(chat_template_kwargs={"messages": []}), "may not set messages"),
    (dict(chat_template="{{ raise_exception('refused') }}"), "template failed.*refused"),
])
def test_chat_template_errors(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2),
                 use_tqdm=False, **kwargs)
    assert_no_leaks(llm.engine)
