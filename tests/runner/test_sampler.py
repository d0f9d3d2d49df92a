from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.sampler import (
    SamplerVariant,
    SamplingRow,
    apply_penalties,
    choose_variant,
    compute_prompt_logprobs,
    first_argmax,
    make_sampling_tensors,
    sample,
    sampler_row_logprobs,
    seed_to_key_data,
)
from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams

SAMPLE = jax.jit(sample, static_argnames=("variant",))
RANDOM = SamplerVariant(do_sample=True)


def run(logits, rows, variant, num_rows=None, **kw):
    logits = np.asarray(logits, np.float32)
    num_rows = logits.shape[0] if num_rows is None else num_rows
    tensors = make_sampling_tensors(rows, num_rows, logits.shape[1], penalties=variant.penalties, **kw)
    return jax.tree.map(np.asarray, SAMPLE(logits, tensors, variant=variant))


def rows_for(params, n, steps=0, seed0=0):
    return [SamplingRow(params, steps, seed=seed0 + i) for i in range(n)]


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_seed_to_key_data_matches_jax():
    for seed in [0, 1, 42, 2**31 - 1, 2**32 - 1]:
        expected = np.asarray(jax.random.key_data(jax.random.PRNGKey(seed)))
        assert seed_to_key_data(seed) == tuple(int(v) for v in expected)


@pytest.mark.parametrize("variant", [SamplerVariant(do_sample=False), RANDOM])
def test_greedy_is_argmax(variant):
    logits = np.random.default_rng(0).normal(size=(8, 100)) * 3
    rows = rows_for(SamplingParams(temperature=0.0), 6)  # 2 padding rows
    out = run(logits, rows, variant)
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))


def test_first_argmax_matches_numpy_on_ties_and_infinities():
    rng = np.random.default_rng(2)
    x = rng.integers(-3, 4, size=(16, 50)).astype(np.float32)   # many ties per row
    x[3] = -np.inf                                               # every token banned
    x[4, 7:] = np.inf                                            # ties at +inf
    got = np.asarray(jax.jit(first_argmax)(x))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, x.argmax(-1))


def test_token_follows_documented_key_derivation():
    # Unfiltered sampling = argmax(logits / T + Gumbel(fold_in(PRNGKey(seed), step))).
    logits = np.random.default_rng(1).normal(size=(4, 64)).astype(np.float32)
    seeds, steps = [3, 3, 11, 2**32 - 5], [0, 7, 2, 1]
    rows = [SamplingRow(SamplingParams(temperature=0.7), s, seed=d) for d, s in zip(seeds, steps)]
    out = run(logits, rows, RANDOM)
    for i, (seed, step) in enumerate(zip(seeds, steps)):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
        g = np.asarray(jax.random.gumbel(key, (64,), jnp.float32))
        assert out.token_ids[i] == np.argmax(logits[i] / np.float32(0.7) + g)


def test_temperature_sampling_matches_softmax():
    base = np.array([2.0, 1.0, 0.5, 0.0, -1.0], np.float32)
    temperature, draws = 0.7, 20000
    logits = np.tile(base, (draws, 1))
    out = run(logits, rows_for(SamplingParams(temperature=temperature), draws), RANDOM)
    counts = np.bincount(out.token_ids, minlength=5)
    expected = np.exp(np_log_softmax(base / temperature)) * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30.0, (counts, expected)  # df=4; p(chi2 > 30) ~ 5e-6


def np_allowed(logits, temperature, top_k, top_p, min_p):
    """Brute-force allowed set, vLLM order: min_p, top_k, then top_p on what is left."""
    probs = np.exp(np_log_softmax(logits / temperature))
    order = np.argsort(-probs)
    keep = probs >= min_p * probs.max()
    if 0 < top_k < len(logits):
        keep &= np.isin(np.arange(len(logits)), order[:top_k])
    kept = np.where(keep, probs, 0.0)
    kept = kept / kept.sum()
    if top_p < 1.0:
        before = 0.0
        for t in order:
            if not keep[t]:
                continue
            if before >= top_p:
                keep[t] = False
            before += kept[t]
    return set(np.flatnonzero(keep).tolist()), kept


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(1.0, 3, 1.0, 0.0), (0.8, 0, 0.6, 0.0), (1.3, 0, 1.0, 0.1), (1.0, 8, 0.9, 0.05), (2.0, 1, 1.0, 0.0)],
)
def test_filters_never_sample_masked_tokens(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(2)
    vocab, draws = 32, 4000
    base = rng.normal(size=vocab).astype(np.float32) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    out = run(np.tile(base, (draws, 1)), rows_for(params, draws), RANDOM)
    allowed, probs = np_allowed(base.astype(np.float64), temperature, top_k, top_p, min_p)
    sampled = set(out.token_ids.tolist())
    assert sampled <= allowed
    # ...and nothing allowed with real mass is filtered out by mistake.
    assert {t for t in allowed if probs[t] > 0.01} <= sampled


def test_mixed_batch_filters_apply_per_row():
    rng = np.random.default_rng(3)
    vocab, per = 16, 500
    base = rng.normal(size=vocab).astype(np.float32)
    settings = [SamplingParams(top_k=2), SamplingParams(), SamplingParams(temperature=0.0)]
    rows = [SamplingRow(settings[i % 3], 0, seed=i) for i in range(3 * per)]
    out = run(np.tile(base, (3 * per, 1)), rows, RANDOM)
    top2 = set(np.argsort(-base)[:2].tolist())
    assert set(out.token_ids[0::3].tolist()) <= top2
    assert len(set(out.token_ids[1::3].tolist())) > 2  # unfiltered row is not clipped
    assert set(out.token_ids[2::3].tolist()) == {int(base.argmax())}


def np_penalties(logits, prompt, output, rep, freq, pres):
    logits = logits.copy()
    seen = set(prompt) | set(output)
    for t in seen:
        logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
    for t in set(output):
        logits[t] -= freq * output.count(t) + pres
    return logits


def penalty_rows():
    return [
        SamplingRow(
            SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3),
            3, prompt_token_ids=[1, 5, 5, 9], output_token_ids=[5, 7, 7],
        ),
        SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=0.7), 1, prompt_token_ids=[0, 2],
                    output_token_ids=[3]),
        SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=-1.0, presence_penalty=2.0), 4,
                    prompt_token_ids=[], output_token_ids=[11, 11, 11, 4]),
    ]


def test_penalties_match_numpy():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(4, 12)).astype(np.float32) * 2
    rows = penalty_rows()
    tensors = make_sampling_tensors(rows, 4, 12, penalties=True)
    got = np.asarray(jax.jit(apply_penalties)(logits, tensors))
    for i, row in enumerate(rows):
        p = row.params
        want = np_penalties(logits[i], list(row.prompt_token_ids), list(row.output_token_ids),
                            p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[3], logits[3])  # padding row untouched
    # End to end: greedy rows take the argmax of the penalised logits.
    out = run(logits, rows, SamplerVariant(do_sample=False, penalties=True))
    np.testing.assert_array_equal(out.token_ids[:3], got[:3].argmax(-1))


def test_penalty_len_bucket_and_errors():
    rows = penalty_rows()
    t = make_sampling_tensors(rows, 4, 12, penalties=True)
    assert t.penalty_token_ids.shape == (4, 16)
    assert (t.penalty_token_ids[3] == 12).all()  # padding ids are out of range (dropped)
    assert make_sampling_tensors(rows, 4, 12, penalties=True, penalty_len=64).penalty_token_ids.shape == (4, 64)
    with pytest.raises(ValueError, match="penalty_len"):
        make_sampling_tensors(rows, 4, 12, penalties=True, penalty_len=4)
    with pytest.raises(ValueError, match="num_rows_padded"):
        make_sampling_tensors(rows, 2, 12)


def test_logprobs_are_raw_with_ranks():
    rng = np.random.default_rng(5)
    vocab = 40
    logits = rng.normal(size=(4, vocab)).astype(np.float32) * 2
    rows = penalty_rows()[:2] + [SamplingRow(SamplingParams(temperature=1.0, top_k=5, logprobs=5), 0, seed=9)]
    variant = SamplerVariant(do_sample=True, penalties=True, logprobs=True)
    out = run(logits, rows, variant)
    ref = np_log_softmax(logits.astype(np.float64))  # before penalties and temperature
    assert out.logprobs.shape == (4, MAX_LOGPROBS + 1)
    for i in range(4):
        tok = out.token_ids[i]
        assert out.logprob_token_ids[i, 0] == tok
        np.testing.assert_allclose(out.logprobs[i, 0], ref[i, tok], atol=1e-5)
        assert out.sampled_rank[i] == 1 + (ref[i] > ref[i, tok]).sum()
        order = np.argsort(-ref[i])[:MAX_LOGPROBS]
        np.testing.assert_array_equal(out.logprob_token_ids[i, 1:], order)
        np.testing.assert_allclose(out.logprobs[i, 1:], ref[i, order], atol=1e-5)
    # Host dict for a request asking for 3: the sampled token plus the top 3.
    d = sampler_row_logprobs(out.logprobs, out.logprob_token_ids, out.sampled_rank, 2, 3, decode=str)
    top3 = np.argsort(-ref[2])[:3].tolist()
    assert list(d)[0] == out.token_ids[2] and set(d) == {int(out.token_ids[2]), *top3}
    for rank, t in enumerate(top3, start=1):
        assert d[t].rank == rank and d[t].decoded_token == str(t)
        np.testing.assert_allclose(d[t].logprob, ref[2, t], atol=1e-5)
    assert sampler_row_logprobs(out.logprobs, out.logprob_token_ids, out.sampled_rank, 2, 0).keys() == {
        int(out.token_ids[2])
    }


def test_logprobs_with_vocab_smaller_than_max():
    logits = np.array([[1.0, 3.0, 2.0, 0.0, -1.0]], np.float32)
    out = run(logits, [SamplingRow(SamplingParams(temperature=0.0), 0)], SamplerVariant(False, False, True))
    np.testing.assert_array_equal(out.logprob_token_ids[0, 1:6], [1, 2, 0, 3, 4])
    assert (out.logprob_token_ids[0, 6:] == -1).all() and np.isneginf(out.logprobs[0, 6:]).all()
    d = sampler_row_logprobs(out.logprobs, out.logprob_token_ids, out.sampled_rank, 0, MAX_LOGPROBS)
    assert sorted(d) == [0, 1, 2, 3, 4]


def test_rows_are_reproducible_whatever_the_batch():
    rng = np.random.default_rng(6)
    vocab = 50
    row_logits = rng.normal(size=(5, vocab)).astype(np.float32)
    params = [
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(temperature=1.2, top_p=0.8, seed=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=4, min_p=0.05, seed=3),
        SamplingParams(temperature=1.5, seed=4),
    ]
    rows = [SamplingRow(p, step) for p, step in zip(params, [0, 3, 1, 5, 2])]
    alone = [run(row_logits[i : i + 1], [rows[i]], RANDOM).token_ids[0] for i in range(5)]
    order = [3, 0, 4, 2, 1]
    mixed = run(np.concatenate([row_logits[order], np.zeros((3, vocab), np.float32)]),
                [rows[i] for i in order], RANDOM)
    assert [mixed.token_ids[j] for j in range(5)] == [alone[i] for i in order]
    # Another step of the same request draws from a different key.
    later = [run(np.tile(row_logits[4], (1, 1)), [SamplingRow(params[4], s)], RANDOM).token_ids[0]
             for s in range(20)]
    assert len(set(later)) > 1


def test_no_recompilation_across_values():
    def fresh(logits, tensors, variant):  # own function: jit caches are per function
        return sample(logits, tensors, variant)

    fn = jax.jit(fresh, static_argnames=("variant",))
    variant = SamplerVariant(do_sample=True, penalties=True, logprobs=True)
    rng = np.random.default_rng(7)
    for trial in range(4):
        params = SamplingParams(
            temperature=float(rng.uniform(0, 2)), top_k=int(rng.integers(0, 10)), top_p=float(rng.uniform(0.1, 1)),
            min_p=float(rng.uniform(0, 0.3)), repetition_penalty=float(rng.uniform(0.5, 2)), seed=trial,
        )
        rows = [SamplingRow(params, trial, prompt_token_ids=[trial] * (trial + 1), output_token_ids=[1, 2])]
        tensors = make_sampling_tensors(rows, 4, 30, penalties=True)
        fn(rng.normal(size=(4, 30)).astype(np.float32), tensors, variant=variant)
    assert fn._cache_size() == 1


def test_choose_variant():
    assert choose_variant([SamplingParams(temperature=0.0)]) == SamplerVariant(False, False, False)
    v = choose_variant([SamplingParams(temperature=0.0, logprobs=2), SamplingParams(presence_penalty=0.1)])
    assert v == SamplerVariant(True, True, True)


def test_compute_prompt_logprobs_matches_numpy():
    rng = np.random.default_rng(8)
    logits = rng.normal(size=(6, 30)).astype(np.float32) * 3
    targets = np.array([0, 5, 29, 7, 7, 12], np.int32)
    lp, rank, top_lp, top_ids = map(np.asarray, jax.jit(compute_prompt_logprobs)(logits, targets))
    ref = np_log_softmax(logits.astype(np.float64))
    np.testing.assert_allclose(lp, ref[np.arange(6), targets], atol=1e-5)
    np.testing.assert_array_equal(rank, 1 + (ref > ref[np.arange(6), targets][:, None]).sum(-1))
    order = np.argsort(-ref, axis=-1)[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(top_ids, order)
    np.testing.assert_allclose(top_lp, np.take_along_axis(ref, order, -1), atol=1e-5)


@pytest.mark.parametrize("variant", [SamplerVariant(do_sample=False), RANDOM,
                                     SamplerVariant(do_sample=True, penalties=True,
                                                    logprobs=True)])
def test_banned_tokens_are_never_sampled(variant):
    # Row 0 bans its two most likely tokens (stop tokens held back by min_tokens); row 1
    # bans nothing. Raw logprobs still describe the unmasked distribution.
    logits = np.tile(np.array([[5.0, 4.0, 3.0, 0.0, -1.0]], np.float32), (2, 1))
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=1.0)
    params = greedy if not variant.do_sample else hot
    rows = [SamplingRow(params, 0, seed=1, banned_token_ids=(0, 1)),
            SamplingRow(params, 0, seed=2)]
    for step in range(20):
        rows = [SamplingRow(r.params, step, seed=r.seed, banned_token_ids=r.banned_token_ids)
                for r in rows]
        out = run(logits, rows, variant)
        assert out.token_ids[0] not in (0, 1)
        if not variant.do_sample:
            assert out.token_ids[0] == 2 and out.token_ids[1] == 0
        if variant.logprobs:
            assert np.allclose(out.logprobs[0, 1:6], np_log_softmax(logits[0])[:5], atol=1e-6)
