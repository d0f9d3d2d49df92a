"""The front door without a model: what InputProcessor.process accepts, what it makes
of it (a frozen EngineRequest with max_tokens resolved), what it refuses (InputError
naming the field), and that it counts both."""
from __future__ import annotations

import dataclasses

import pytest

from jaxserve.errors import InputError
from jaxserve.engine.input_processor import EngineRequest, InputProcessor
from jaxserve.sampling_params import SamplingParams


@pytest.fixture
def inputs() -> InputProcessor:
    return InputProcessor(tokenizer=None, vocab_size=100, max_model_len=32)


def test_process_makes_a_frozen_request_with_max_tokens_resolved(inputs):
    req = inputs.process("r", [5, 6, 7], SamplingParams(max_tokens=None, min_tokens=40),
                         text="hi", priority=3, arrival_time=1.5)
    assert isinstance(req, EngineRequest)
    assert req.request_id == "r" and req.prompt_token_ids == (5, 6, 7)
    assert req.prompt == "hi" and req.priority == 3 and req.arrival_time == 1.5
    # The room the prompt leaves: max_model_len - 3; min_tokens is capped to it.
    assert req.sampling_params.max_tokens == 29 and req.sampling_params.min_tokens == 29
    assert req.num_prompt_tokens == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.priority = 0   # type: ignore[misc]
    assert (inputs.num_processed, inputs.num_refused) == (1, 0)


def test_the_caller_cannot_change_a_request_after_the_fact(inputs):
    ids = [5, 6]
    req = inputs.process("r", ids, SamplingParams())
    ids.append(10**9)
    assert req.prompt_token_ids == (5, 6)


@pytest.mark.parametrize("prompt, params, kwargs, param, message", [
    ([], SamplingParams(), {}, "prompt", "prompt must not be empty"),
    ("", SamplingParams(), {}, "prompt", "prompt must not be empty"),
    ([5, 100], SamplingParams(), {}, "prompt", "token id 100 is outside"),
    ([5, True], SamplingParams(), {}, "prompt", "list of ints"),
    ([5] * 32, SamplingParams(), {}, "prompt", "max_model_len"),
    ([5] * 30, SamplingParams(max_tokens=3), {}, "max_tokens", "max_tokens=3 cannot fit"),
    ([5], SamplingParams(stop_token_ids=[100]), {}, "stop_token_ids", "outside"),
    ([5], SamplingParams(stop_token_ids=list(range(16)), min_tokens=1), {},
     "stop_token_ids", "at most 15"),
    ([5], SamplingParams(), {"priority": "high"}, "priority", "priority must be an int"),
    ("hi", SamplingParams(), {}, "prompt", "no tokenizer"),   # this one has none
])
def test_refusals_name_their_field_and_are_counted(inputs, prompt, params, kwargs, param,
                                                   message):
    with pytest.raises(InputError, match=message) as e:
        inputs.process("r", prompt, params, **kwargs)
    assert e.value.param == param
    assert (inputs.num_processed, inputs.num_refused) == (0, 1)


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(n=0), "n"), (dict(max_tokens=-1), "max_tokens"), (dict(seed=2**64), "seed"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(stop=[""]), "stop"),
])
def test_sampling_params_refusals_carry_their_field(kwargs, param):
    with pytest.raises(InputError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and isinstance(e.value, ValueError)
