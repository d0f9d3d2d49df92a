"""The sampler's token constraints: the per-row bitmask (allowed_token_ids, bad words,
grammars) and logit bias, on device, in the one sampler program; and their host side
(jaxserve/runner/token_constraints.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.bad_words import BadWords
from jaxserve.runner.sampler import allowed_tokens, sample
from jaxserve.runner.sampling_tensors import SamplingRow, make_sampling_tensors, mask_words
from jaxserve.runner.token_constraints import (ALL_ALLOWED, DynamicConstraints, set_tokens,
                                               static_mask)
from jaxserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams

V = 100      # not a multiple of 32: the last mask word is partly past the vocabulary
SAMPLE = jax.jit(sample, static_argnames=("penalties", "greedy"))


def test_allowed_tokens_unpacks_the_bit_layout():
    rng = np.random.default_rng(0)
    mask = rng.integers(0, 2**32, (3, mask_words(V)), dtype=np.uint64).astype(np.uint32)
    got = np.asarray(allowed_tokens(jnp.asarray(mask), V))
    want = np.array([[(mask[r, t // 32] >> (t % 32)) & 1 for t in range(V)] for r in range(3)],
                    bool)
    np.testing.assert_array_equal(got, want)


def test_set_tokens_sets_and_clears_single_bits():
    row = np.zeros(mask_words(V), np.uint32)
    set_tokens(row, [0, 31, 32, 99], True)
    assert np.asarray(allowed_tokens(jnp.asarray(row[None]), V))[0].nonzero()[0].tolist() == \
        [0, 31, 32, 99]
    row[:] = ALL_ALLOWED
    set_tokens(row, [5, 5, 64], False)
    allowed = np.asarray(allowed_tokens(jnp.asarray(row[None]), V))[0]
    assert not allowed[5] and not allowed[64] and allowed.sum() == V - 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_only_allowed_tokens_are_sampled(temperature):
    """Random logits favour the banned tokens; over many seeds every draw is allowed,
    and a greedy row takes the best allowed token."""
    rng = np.random.default_rng(1)
    allowed = sorted(rng.choice(V, 7, replace=False).tolist())
    logits = rng.normal(size=(64, V)).astype(np.float32)
    logits[:, [t for t in range(V) if t not in allowed]] += 5.0
    params = SamplingParams(temperature=temperature, allowed_token_ids=allowed)
    rows = [SamplingRow(params, 0, seed=i) for i in range(64)]
    out = SAMPLE(logits, make_sampling_tensors(rows, 64, V))
    ids = np.asarray(out.token_ids)
    assert set(ids.tolist()) <= set(allowed)
    if temperature == 0.0:
        np.testing.assert_array_equal(ids, np.array(allowed)[logits[:, allowed].argmax(-1)])
    else:
        assert len(set(ids.tolist())) > 3      # sampled, not collapsed onto one token


def test_greedy_program_reads_the_mask_too():
    logits = np.zeros((2, V), np.float32)
    logits[:, 3] = 10.0
    rows = [SamplingRow(SamplingParams(temperature=0.0, allowed_token_ids=[7, 9]), 0),
            SamplingRow(SamplingParams(temperature=0.0), 0)]
    out = SAMPLE(logits, make_sampling_tensors(rows, 2, V), greedy=True)
    assert np.asarray(out.token_ids).tolist() == [7, 3]


def test_logit_bias_moves_the_argmax_and_keeps_raw_logprobs():
    logits = np.zeros((2, V), np.float32)
    logits[:, 3] = 2.0
    rows = [SamplingRow(SamplingParams(temperature=0.0, logit_bias={50: 3.0}, logprobs=1), 0),
            SamplingRow(SamplingParams(temperature=0.0, logit_bias={50: 1.0}, logprobs=1), 0)]
    t = make_sampling_tensors(rows, 2, V)
    assert (np.asarray(t.logit_bias_ids)[:, 1:] == V).all()          # unused entries: V
    out = SAMPLE(logits, t)
    assert np.asarray(out.token_ids).tolist() == [50, 3]
    # logprobs are the model's (as vLLM's default raw logprobs), not the biased ones
    lp = np.asarray(out.logprobs)[0, 0]
    assert abs(lp - (0.0 - np.log(np.exp(2.0) + V - 1))) < 1e-5


def test_logit_bias_validation_and_clamp():
    assert SamplingParams(logit_bias={"5": 300, 6: -1e9}).logit_bias == {5: 100.0, 6: -100.0}
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    for key in ("\u0663", "\u00b3", "-1", " 5", "5_0", "9" * 5000):   # ASCII digits only
        with pytest.raises(ValueError, match="logit_bias key .* is not a token id"):
            SamplingParams(logit_bias={key: 1.0})
    assert SamplingParams(logit_bias={"007": 1.0}).logit_bias == {7: 1.0}
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[""])


def test_static_mask_combines_allowed_ids_and_single_token_bad_words():
    row = np.zeros(mask_words(V), np.uint32)
    p = SamplingParams(allowed_token_ids=[1, 2, 3], bad_words=["b"],
                       bad_words_automaton=BadWords([(2,), (4, 5)]))
    assert static_mask(p, row)
    assert np.asarray(allowed_tokens(jnp.asarray(row[None]), V))[0].nonzero()[0].tolist() == [1, 3]
    assert not static_mask(SamplingParams(), row) and (row == ALL_ALLOWED).all()


def test_bad_word_of_several_tokens_is_banned_only_after_its_prefix():
    p = SamplingParams(bad_words=["ab"], bad_words_automaton=BadWords([(4, 5, 6)]))
    for history, banned in (([], False), ([4], False), ([9, 4, 5], True), ([4, 5, 7], False)):
        dyn = DynamicConstraints(p, history)
        row = np.full(mask_words(V), ALL_ALLOWED, np.uint32)
        dyn.fill(row)
        assert (not np.asarray(allowed_tokens(jnp.asarray(row[None]), V))[0, 6]) == banned
