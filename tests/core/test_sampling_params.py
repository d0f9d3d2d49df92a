from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import numpy as np

from jaxserve.sampling_params import (INT32_MAX, INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_N,
                                      RequestOutputKind, SamplingParams, SamplingType)

REPO = Path(__file__).resolve().parents[2]


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert p.max_tokens == 16 and p.min_tokens == 0 and not p.ignore_eos
    assert p.logprobs is None and p.prompt_logprobs is None
    assert not p.include_stop_str_in_output
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert MAX_LOGPROBS == 20


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(n=1.5), "n"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(presence_penalty=-2.5), "presence_penalty"),
        (dict(frequency_penalty=2.01), "frequency_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        # (the engine's max_logprobs is the front door's: tests/engine/test_llm_vllm_names.py)
        (dict(logprobs=INT32_MAX + 1), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(prompt_logprobs=2.0), "prompt_logprobs"),
        (dict(n=3, best_of=2), "best_of"),
        (dict(best_of=MAX_N + 1), "best_of"),
        (dict(best_of=2.0), "best_of"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
        (dict(truncate_prompt_tokens=1.5), "truncate_prompt_tokens"),
        (dict(output_kind=1), "output_kind"),
        (dict(output_kind="delta"), "output_kind"),
        (dict(stop_token_ids=[np.float32(3)]), "stop_token_ids"),
        (dict(seed=np.bool_(True)), "seed"),
        (dict(stop=""), "stop"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop=[3]), "stop"),
        (dict(seed=1.5), "seed"),
        (dict(seed="7"), "seed"),
        (dict(seed=True), "seed"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        # Past what the device arrays hold (int32) or OpenAI documents (int64 seeds).
        (dict(n=MAX_N + 1), "n"),
        (dict(top_k=INT32_MAX + 1), "top_k"),
        (dict(stop_token_ids=[INT32_MAX + 1]), "stop_token_ids"),
        (dict(seed=INT64_MAX + 1), "seed"),
        (dict(seed=INT64_MIN - 1), "seed"),
        # Non-finite floats (a NaN temperature would sample token 0 for ever).
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(presence_penalty=float("-inf")), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    ],
)
def test_validation_errors_name_field_and_value(kwargs, field):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    assert message.startswith(field)
    assert repr(next(iter(kwargs.values()))) in message


def test_boundary_values_are_accepted():
    SamplingParams(top_p=1.0, min_p=1.0, top_k=0, presence_penalty=2.0, frequency_penalty=-2.0)
    SamplingParams(logprobs=0, prompt_logprobs=MAX_LOGPROBS, min_tokens=16, max_tokens=16)
    SamplingParams(temperature=0.0, seed=0, min_tokens=100, max_tokens=None)
    SamplingParams(n=MAX_N, top_k=INT32_MAX, stop_token_ids=[INT32_MAX], seed=INT64_MIN)


def test_children_of_the_largest_seed_stay_valid():
    # seed + index wraps in 64 bits instead of failing validation at add time
    assert [SamplingParams(n=2, seed=INT64_MAX).child(i).seed for i in range(2)] == \
        [INT64_MAX, INT64_MIN]


def test_greedy_and_sampling_type():
    greedy = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2)
    assert greedy.is_greedy and greedy.sampling_type == SamplingType.GREEDY
    # Filters cannot change an argmax, so greedy requests drop them.
    assert (greedy.top_k, greedy.top_p, greedy.min_p) == (0, 1.0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(temperature=0.5).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.5, seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert not SamplingParams(temperature=0.5, top_k=3).is_greedy


def test_has_penalties_and_max_stop_len():
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties
    assert SamplingParams(stop=["a", "abcd"]).max_stop_len == 4


def test_frozen_clone_and_children():
    p = SamplingParams(n=3, seed=10, stop=["x"], temperature=0.7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]
    q = p.clone()
    assert q == p and q.stop is not p.stop
    children = [p.child(i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 and c.temperature == 0.7 and c.stop == ["x"] for c in children)
    assert SamplingParams(n=2).child(1).seed is None
    with pytest.raises(ValueError, match="child index"):
        p.child(3)
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=-1.0)


def test_core_modules_do_not_import_jax():
    code = (
        "import sys\n"
        "import jaxserve.sampling_params, jaxserve.core.outputs, jaxserve.engine.detokenizer\n"
        "import jaxserve.engine.logprobs\n"
        "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_new_vllm_fields_default_and_accept():
    p = SamplingParams()
    assert p.best_of is None and p.truncate_prompt_tokens is None
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert (p.num_samples, p.ranks_samples) == (1, False)
    q = SamplingParams(n=2, best_of=5, truncate_prompt_tokens=-1,
                       output_kind=RequestOutputKind.DELTA, logprobs=MAX_LOGPROBS + 5)
    assert (q.num_samples, q.ranks_samples, q.truncate_prompt_tokens) == (5, True, -1)
    assert SamplingParams(n=3, best_of=3).ranks_samples is False
    assert [o.value for o in RequestOutputKind] == [0, 1, 2]


def test_best_of_children():
    p = SamplingParams(n=2, best_of=4, seed=7, temperature=0.8)
    kids = [p.child(i) for i in range(4)]
    assert [k.seed for k in kids] == [7, 8, 9, 10]
    # Ranking needs every sample's logprob: the children ask for it.
    assert all(k.n == 1 and k.best_of is None and k.logprobs == 0 for k in kids)
    assert SamplingParams(n=2, best_of=4, logprobs=3).child(0).logprobs == 3
    assert SamplingParams(n=2, best_of=2).child(1).logprobs is None
    with pytest.raises(ValueError, match="child index"):
        p.child(4)


def test_from_optional_takes_defaults_for_none():
    p = SamplingParams.from_optional(n=None, temperature=None, top_p=None, top_k=None,
                                     presence_penalty=None, min_tokens=None, seed=None,
                                     stop=None, logprobs=None, max_tokens=None, best_of=None)
    d = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.presence_penalty, p.min_tokens) == \
        (d.n, d.temperature, d.top_p, d.top_k, d.presence_penalty, d.min_tokens)
    # As vLLM's: where None is a value of the field it stays (max_tokens None: no limit).
    assert p.seed is None and p.stop == [] and p.logprobs is None and p.max_tokens is None
    assert SamplingParams.from_optional(temperature=0.5, n=2).temperature == 0.5
    with pytest.raises(TypeError, match="no_such_field"):
        SamplingParams.from_optional(no_such_field=None)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_optional(top_p=2.0)


def test_numpy_integers_are_ints():
    i64, i32 = np.int64, np.int32
    p = SamplingParams(n=i64(2), top_k=i32(5), seed=i64(3), max_tokens=i64(8),
                       logprobs=i32(2), stop_token_ids=[i64(7), i32(9)],
                       logit_bias={i64(4): 1.0}, allowed_token_ids=list(np.arange(3, 6)),
                       best_of=i64(3), truncate_prompt_tokens=i32(4))
    assert p.stop_token_ids == [7, 9] and p.allowed_token_ids == [3, 4, 5]
    assert list(p.logit_bias) == [4]
    values = [p.n, p.top_k, p.seed, p.max_tokens, p.logprobs, p.best_of,
              p.truncate_prompt_tokens, *p.stop_token_ids, *p.allowed_token_ids,
              *p.logit_bias]
    assert all(type(v) is int for v in values), [type(v) for v in values]
    assert [c.seed for c in (p.child(0), p.child(2))] == [3, 5]
