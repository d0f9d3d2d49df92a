from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.sampler import (TOP_CANDIDATES, _keep_mask, _thresholds, apply_penalties,
                                     compute_prompt_logprobs, first_argmax, only_greedy, sample)
from jaxserve.runner.sampling_tensors import SamplingRow, make_sampling_tensors, seed_to_key_data
from jaxserve.engine.logprobs import make_logprob_dict
from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams

SAMPLE = jax.jit(sample, static_argnames=("penalties",))


def sampler_row_logprobs(logprobs, logprob_token_ids, sampled_rank, row: int, num_logprobs: int,
                         decode=None):
    """make_logprob_dict for row `row` of a SamplerOutput read back to the host: column 0
    is the sampled token, the rest the most likely ones (as the output processor reads it)."""
    lp, ids = np.asarray(logprobs[row]), np.asarray(logprob_token_ids[row])
    return make_logprob_dict(int(ids[0]), float(lp[0]), int(sampled_rank[row]), ids[1:], lp[1:],
                             num_logprobs, decode)


def run(logits, rows, penalties=False, num_rows=None, **kw):
    logits = np.asarray(logits, np.float32)
    num_rows = logits.shape[0] if num_rows is None else num_rows
    tensors = make_sampling_tensors(rows, num_rows, logits.shape[1], penalties=penalties, **kw)
    return jax.tree.map(np.asarray, SAMPLE(logits, tensors, penalties=penalties))


def rows_for(params, n, steps=0, seed0=0):
    return [SamplingRow(params, steps, seed=seed0 + i) for i in range(n)]


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_seed_to_key_data_matches_jax():
    for seed in [0, 1, 42, 2**31 - 1, 2**32 - 1]:
        expected = np.asarray(jax.random.key_data(jax.random.PRNGKey(seed)))
        assert seed_to_key_data(seed) == tuple(int(v) for v in expected)


@pytest.mark.parametrize("hot_row", [False, True])
def test_greedy_is_argmax(hot_row):
    # Greedy rows take the argmax alone and beside a sampled row (the sampling branch).
    logits = np.random.default_rng(0).normal(size=(8, 100)) * 3
    rows = rows_for(SamplingParams(temperature=0.0), 6)  # 2 padding rows
    if hot_row:
        rows[5] = SamplingRow(SamplingParams(temperature=1.0, top_p=0.5), 0, seed=3)
    out = run(logits, rows)
    np.testing.assert_array_equal(out.token_ids[:5], logits.argmax(-1)[:5])
    np.testing.assert_array_equal(out.token_ids[6:], logits.argmax(-1)[6:])


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
    out = run(logits, rows)
    for i, (seed, step) in enumerate(zip(seeds, steps)):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
        g = np.asarray(jax.random.gumbel(key, (64,), jnp.float32))
        assert out.token_ids[i] == np.argmax(logits[i] / np.float32(0.7) + g)


def test_temperature_sampling_matches_softmax():
    base = np.array([2.0, 1.0, 0.5, 0.0, -1.0], np.float32)
    temperature, draws = 0.7, 20000
    logits = np.tile(base, (draws, 1))
    out = run(logits, rows_for(SamplingParams(temperature=temperature), draws))
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
    out = run(np.tile(base, (draws, 1)), rows_for(params, draws))
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
    out = run(np.tile(base, (3 * per, 1)), rows)
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
    out = run(logits, rows, penalties=True)
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
    out = run(logits, rows, penalties=True)
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
    out = run(logits, [SamplingRow(SamplingParams(temperature=0.0, logprobs=MAX_LOGPROBS), 0)])
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
    alone = [run(row_logits[i : i + 1], [rows[i]]).token_ids[0] for i in range(5)]
    order = [3, 0, 4, 2, 1]
    mixed = run(np.concatenate([row_logits[order], np.zeros((3, vocab), np.float32)]),
                [rows[i] for i in order])
    assert [mixed.token_ids[j] for j in range(5)] == [alone[i] for i in order]
    # Another step of the same request draws from a different key.
    later = [run(np.tile(row_logits[4], (1, 1)), [SamplingRow(params[4], s)]).token_ids[0]
             for s in range(20)]
    assert len(set(later)) > 1


def test_no_recompilation_across_values():
    def fresh(logits, tensors):  # own function: jit caches are per function
        return sample(logits, tensors)

    fn = jax.jit(fresh)
    rng = np.random.default_rng(7)
    for trial in range(6):   # greedy, sampled, filtered, logprobs: all one program
        params = SamplingParams(
            temperature=float(rng.uniform(0, 2)) * (trial % 3 > 0), top_k=int(rng.integers(0, 10)),
            top_p=float(rng.uniform(0.1, 1)), min_p=float(rng.uniform(0, 0.3)), seed=trial,
            logprobs=trial if trial % 2 else None)
        tensors = make_sampling_tensors([SamplingRow(params, trial)], 4, 30)
        fn(rng.normal(size=(4, 30)).astype(np.float32), tensors)
    assert fn._cache_size() == 1


def test_greedy_program_is_the_argmax_after_banned_tokens():
    logits = np.random.default_rng(15).normal(size=(6, 40)).astype(np.float32)
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0, banned_token_ids=(int(logits[0].argmax()),))]
    rows += rows_for(SamplingParams(temperature=0.0), 4)
    tensors = make_sampling_tensors(rows, 6, 40)
    got = jax.jit(sample, static_argnames=("greedy",))(logits, tensors, greedy=True)
    np.testing.assert_array_equal(np.asarray(got.token_ids), run(logits, rows).token_ids)
    assert got.token_ids[0] != logits[0].argmax()
    assert only_greedy([SamplingParams(temperature=0.0)])
    assert not only_greedy([SamplingParams(temperature=0.0, logprobs=1)])
    assert not only_greedy([SamplingParams(temperature=0.0), SamplingParams(temperature=0.5)])


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


@pytest.mark.parametrize("do_sample, penalties", [(False, False), (True, False), (True, True)])
def test_banned_tokens_are_never_sampled(do_sample, penalties):
    # Row 0 bans its two most likely tokens (stop tokens held back by min_tokens); row 1
    # bans nothing. Raw logprobs still describe the unmasked distribution.
    logits = np.tile(np.array([[5.0, 4.0, 3.0, 0.0, -1.0]], np.float32), (2, 1))
    greedy = SamplingParams(temperature=0.0)
    hot = SamplingParams(temperature=1.0)
    params = greedy if not do_sample else hot
    params = dataclasses.replace(params, logprobs=5 if penalties else None)
    rows = [SamplingRow(params, 0, seed=1, banned_token_ids=(0, 1)),
            SamplingRow(params, 0, seed=2)]
    for step in range(20):
        rows = [SamplingRow(r.params, step, seed=r.seed, banned_token_ids=r.banned_token_ids)
                for r in rows]
        out = run(logits, rows, penalties=penalties)
        assert out.token_ids[0] not in (0, 1)
        if not do_sample:
            assert out.token_ids[0] == 2 and out.token_ids[1] == 0
        if penalties:
            assert np.allclose(out.logprobs[0, 1:6], np_log_softmax(logits[0])[:5], atol=1e-6)


def keep_of(logits, rows):
    """The sampler's kept set per row (its _keep_mask on temperature-scaled logits)."""
    logits = np.asarray(logits, np.float32)
    t = make_sampling_tensors(rows, logits.shape[0], logits.shape[1])
    temp = np.where(t.temperature < 1e-5, 1.0, t.temperature).astype(np.float32)
    scaled = logits / temp[:, None]
    filtered = np.ones(logits.shape[0], bool)
    # A new function each call: a fresh trace sees a monkeypatched sort path.
    return np.asarray(jax.jit(lambda *a: _keep_mask(*a))(scaled, t, filtered)), scaled, t


CANDIDATE_CASES = [  # (top_k, top_p, min_p): inside the candidates, or not
    (5, 1.0, 0.0), (TOP_CANDIDATES, 0.9, 0.0), (100, 0.5, 0.05), (0, 0.7, 0.0),
    (0, 1.0, 0.02), (0, 0.95, 0.01), (300, 1.0, 0.3), (0, 0.2, 0.0), (1, 0.9, 0.0),
]


def test_candidates_match_the_exact_filters():
    # Peaked rows (a nucleus of a few dozen tokens): every setting is decided on the
    # TOP_CANDIDATES most likely tokens, and the kept sets equal numpy's brute force.
    rng = np.random.default_rng(11)
    vocab = 4 * TOP_CANDIDATES + 37
    params = [SamplingParams(temperature=0.8, top_k=k, top_p=p, min_p=m) for k, p, m in CANDIDATE_CASES]
    logits = (rng.standard_normal((len(params), vocab)) * 4).astype(np.float32)
    keep, scaled, _ = keep_of(logits, [SamplingRow(p, 0) for p in params])
    for i, p in enumerate(params):
        allowed, _ = np_allowed(logits[i].astype(np.float64), p.temperature, p.top_k, p.top_p, p.min_p)
        assert set(np.flatnonzero(keep[i]).tolist()) == allowed, (i, p)


def test_covered_rows_never_sort(monkeypatch):
    # With the sort path broken (keeps nothing), rows the candidates cover are unchanged.
    from jaxserve.runner import sampler
    rng = np.random.default_rng(12)
    vocab = 3 * TOP_CANDIDATES
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p, min_p=m) for k, p, m in CANDIDATE_CASES]
    logits = (rng.standard_normal((len(params), vocab)) * 4).astype(np.float32)
    rows = [SamplingRow(p, 0) for p in params]
    want, _, _ = keep_of(logits, rows)
    monkeypatch.setattr(sampler, "_thresholds", lambda scaled, t: jnp.full(scaled.shape[:1], jnp.inf))
    got, _, _ = keep_of(logits, rows)
    np.testing.assert_array_equal(got, want)
    assert got.sum(-1).min() >= 1


def test_wide_nucleus_falls_back_to_the_sort(monkeypatch):
    # Nearly flat rows: top_p 0.95 (no top_k) or top_k between the candidates and V keeps
    # far more than TOP_CANDIDATES tokens; those rows take the exact sort, others do not.
    from jaxserve.runner import sampler
    rng = np.random.default_rng(13)
    vocab = 4 * TOP_CANDIDATES
    logits = (rng.standard_normal((4, vocab)) * 0.05).astype(np.float32)
    params = [SamplingParams(temperature=1.0, top_p=0.95),
              SamplingParams(temperature=1.0, top_k=3 * TOP_CANDIDATES, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=7),
              SamplingParams(temperature=1.0, top_k=2 * TOP_CANDIDATES, min_p=0.999)]
    rows = [SamplingRow(p, 0) for p in params]
    keep, _, _ = keep_of(logits, rows)
    for i, p in enumerate(params):
        allowed, _ = np_allowed(logits[i].astype(np.float64), p.temperature, p.top_k, p.top_p, p.min_p)
        assert set(np.flatnonzero(keep[i]).tolist()) == allowed, i
    assert keep[0].sum() > TOP_CANDIDATES and keep[1].sum() > TOP_CANDIDATES
    # The wide rows really came from the sort: with it broken they keep one token (the
    # first kept is always kept) and the covered row keeps its 7.
    monkeypatch.setattr(sampler, "_thresholds", lambda scaled, t: jnp.full(scaled.shape[:1], jnp.inf))
    broken, _, _ = keep_of(logits, rows)
    assert broken[0].sum() == 0 and broken[1].sum() == 0 and broken[2].sum() == 7


def test_sort_path_thresholds_match_numpy():
    rng = np.random.default_rng(14)
    vocab = 300
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p, min_p=m) for k, p, m in CANDIDATE_CASES]
    logits = (rng.standard_normal((len(params), vocab)) * 2).astype(np.float32)
    t = make_sampling_tensors([SamplingRow(p, 0) for p in params], len(params), vocab)
    thr = np.asarray(jax.jit(_thresholds)(logits, t))
    for i, p in enumerate(params):
        allowed, _ = np_allowed(logits[i].astype(np.float64), 1.0, p.top_k, p.top_p, p.min_p)
        assert set(np.flatnonzero(logits[i] >= thr[i]).tolist()) == allowed, i
