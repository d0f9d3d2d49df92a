"""Speculative decoding keeps the target's distribution (temperature > 0), measured.

A toy "model" over a tiny vocabulary: the logits of the j-th output token are a fixed
random table indexed by the outputs before it. Thousands of seeded requests run through
the real host-side path -- Scheduler (num_speculative_tokens), InputBatch (drafts written
after the known tokens, the sampler's window rows and their steps), the jitted sampler,
ModelRunner._collect_verified (num_accepted) -- with two proposers: the runner's own
ModelRunner._propose (ngram prompt lookup, drafts unrelated to the toy's distribution)
and a "close" one (greedy under perturbed tables: often right, so deep acceptance is
common). The empirical joint distribution of the 4 output tokens is compared with the
exact one (softmax(logits / T), top_k / top_p applied) by a chi-square test. Negative
controls (wrong verifications) run through the same harness and must be rejected by the
same statistic, so the test is known to have the power to see a wrong implementation.

Exactness is also checked directly: a seeded request draws, with speculation, the very
tokens (and logprobs) it draws without -- each token's key is fold_in(seed, its output
index), and penalties / min_tokens see the history up to each window position.
"""
from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from scipy import stats

from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.model_runner import ModelRunner, ModelRunnerOutput
from jaxserve.runner.sampler import sample
from jaxserve.runner.spec_decode import num_accepted
from jaxserve.sampling_params import SamplingParams
from jaxserve.config.speculative import SpeculativeConfig

V = 5            # vocabulary
L = 4            # output tokens per request (max_tokens)
K = 2            # drafts per step
PS, MML = 8, 32
# Every token occurs in the prompt, so a 1-gram lookup always proposes something.
PROMPT = [0, 1, 2, 3, 4, 0, 2, 4, 1, 3, 0, 3]
N = 8192         # requests (seeds) per run
# One padded sampler batch for every run (one compile): the most rows a step may have.
NUM_ROWS = N * (1 + K)

SAMPLE = jax.jit(sample, static_argnames=("penalties",))

rng = np.random.default_rng(1234)
# TABLES[j][index of the j previous outputs] -> logits of output j.
TABLES = [rng.normal(size=(V ** j, V)).astype(np.float32) * 1.5 for j in range(L)]
# A second proposer, close to the target but not it: the greedy continuation under
# perturbed tables (so drafts are often right, and deep acceptance is exercised too).
CLOSE = [t + rng.normal(size=t.shape).astype(np.float32) * 0.5 for t in TABLES]


def prefix_index(outputs: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Index of each row's first `depth` outputs in TABLES[depth] (row-major, base V)."""
    idx = np.zeros(len(depth), np.int64)
    for j in range(outputs.shape[1]):
        idx = np.where(j < depth, idx * V + outputs[:, j], idx)
    return idx


def toy_logits(outputs: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """[S, V] logits of the next token after each row's first `depth` outputs."""
    out = np.zeros((len(depth), V), np.float32)
    idx = prefix_index(outputs, depth)
    for j in range(L):
        m = depth == j
        out[m] = TABLES[j][idx[m]]
    return out


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The target's distribution for sampling params: softmax(logits / T), then top_k,
    then top_p over what is left (the sampler's order); rows of [.., V]."""
    z = logits / params.temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")
    ranked = np.take_along_axis(p, order, -1)
    keep = np.ones_like(ranked, bool)
    if 0 < params.top_k < V:
        keep[..., params.top_k:] = False
    ranked = np.where(keep, ranked, 0.0)
    if params.top_p < 1.0:
        total = ranked.sum(-1, keepdims=True)
        before = (np.cumsum(ranked, -1) - ranked) / total
        keep &= before < params.top_p
        ranked = np.where(keep, ranked, 0.0)
    out = np.zeros_like(p)
    np.put_along_axis(out, order, ranked, -1)
    return out / out.sum(-1, keepdims=True)


def exact_joint(params: SamplingParams) -> np.ndarray:
    """P(o_0, ..., o_{L-1}) as an array [V] * L."""
    joint = np.ones(())
    for j in range(L):
        probs = target_probs(TABLES[j], params).reshape([V] * j + [V])
        joint = joint[..., None] * probs
    return joint


def chi_square_p(outputs: np.ndarray, params: SamplingParams) -> float:
    """p-value of the outputs [n, L] under the exact joint distribution; cells expected
    fewer than 5 times are pooled. Sampling a token the target excludes gives 0."""
    p = exact_joint(params).reshape(-1)
    idx = prefix_index(outputs, np.full(len(outputs), L))
    counts = np.bincount(idx, minlength=V ** L)
    if counts[p == 0].any():
        return 0.0
    expected = p * len(outputs)
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(stats.chi2.sf(stat, len(obs) - 1))


# ---- the harness: real scheduler, batch, sampler and verification ----------------------

def collect_verified_variant(variant: str):
    """Wrong verifications (negative controls), as drop-ins for _collect_verified:
    accept_all: every draft is taken as if it had been drawn;
    coin: the textbook mistake -- accept draft d with probability p(d), else keep the
          token drawn there (which may be d again), instead of drawing from p without d;
    argmax: accept a draft when it is the most likely token, else keep the draw."""
    coin_rng = np.random.default_rng(7)

    def collect(runner, rows, result, logprobs, out):
        batch, tokens = runner.batch, result.token_ids
        first = 0
        for i in np.flatnonzero(rows.sample):
            row, k = rows.rows[i], int(rows.num_drafts[i])
            drawn = tokens[first:first + k + 1]
            known = batch.num_tokens[row]
            drafts = batch.tokens[row, known:known + k].tolist()
            probs = None if runner.probs is None else runner.probs[first:first + k + 1]
            a = 0
            while a < k:
                d = drafts[a]
                if variant == "accept_all":
                    ok = True
                elif variant == "coin":
                    ok = coin_rng.random() < probs[a, d]
                else:
                    ok = d == int(np.argmax(probs[a]))
                if not ok:
                    break
                a += 1
            new = drafts[:a] + [int(drawn[a])]
            batch.append_verified(row, new)
            out.sampled[rows.req_ids[i]] = new if k else new[0]
            first += k + 1

    return collect


def propose_close(batch: InputBatch, rows, k: int) -> dict[str, list[int]]:
    """The CLOSE proposer: for each row that sampled, k greedy tokens under CLOSE."""
    out = {}
    for i in np.flatnonzero(rows.sample):
        row = rows.rows[i]
        outputs = batch.tokens[row, len(PROMPT):batch.num_tokens[row]].tolist()
        drafts = []
        while len(drafts) < k and len(outputs) + len(drafts) < L:
            seq = outputs + drafts
            idx = prefix_index(np.array([seq + [0] * (L - len(seq))]), np.array([len(seq)]))
            drafts.append(int(np.argmax(CLOSE[len(seq)][idx[0]])))
        if drafts:
            out[rows.req_ids[i]] = drafts
    return out


def run(params: SamplingParams, k: int, n: int = N, seed0: int = 0,
        variant: str | None = None, proposer: str = "ngram", full: bool = False):
    """n requests (params with seeds seed0..) generate up to L tokens each; k drafts a
    step (0: no speculation) from `proposer` (ngram: the runner's own,
    ModelRunner._propose; close: propose_close). -> (outputs [n, L], the scheduler), or
    with full=True (outputs as lists, the scheduler, {req_id: per-token logprob entries})."""
    sched = Scheduler(SchedulerConfig(
        num_pages=n * (-(-MML // PS)) + 1, page_size=PS, max_num_seqs=n,
        max_num_batched_tokens=n * MML, max_model_len=MML, num_speculative_tokens=k))
    batch = InputBatch(max_num_seqs=n, max_model_len=MML, page_size=PS, token_buckets=(16,),
                       vocab_size=V, num_speculative_tokens=k)
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1,
                             prompt_lookup_max=2) if k else None
    runner = SimpleNamespace(batch=batch, spec=spec, probs=None)
    reqs = []
    for i in range(n):
        r = Request(f"r{i}", PROMPT, dataclasses.replace(params, seed=seed0 + i),
                    eos_token_id=None, page_size=PS)
        sched.add_request(r)
        reqs.append(r)
    penalties, want_lps = params.has_penalties, params.logprobs is not None
    logprobs: dict[str, list] = {r.request_id: [] for r in reqs}
    collect = ModelRunner._collect_verified if variant in (None, "same_key") else \
        collect_verified_variant(variant)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        rows = batch.update(out, ())
        tensors = batch.sampling_tensors(rows, NUM_ROWS, penalties=penalties, penalty_len=MML)
        if rows.num_drafts is None:
            batch_row, offset = np.arange(rows.num_reqs), np.zeros(rows.num_reqs, np.int64)
        else:
            batch_row, offset = rows.sample_rows()
            if variant == "same_key":   # every window position drawn with its first key
                steps = np.asarray(tensors.steps).copy()
                steps[:len(offset)] -= offset
                tensors = tensors.replace(steps=steps)
        prow = rows.rows[batch_row]
        known = batch.num_tokens[prow] + offset
        depth = known - batch.num_prompt[prow]
        outputs = batch.tokens[prow, len(PROMPT):len(PROMPT) + L]
        logits = np.zeros((NUM_ROWS, V), np.float32)
        logits[:len(prow)] = toy_logits(outputs, np.minimum(depth, L - 1))
        if variant in ("coin", "argmax"):
            runner.probs = target_probs(logits[:len(prow)], params)
        result = jax.device_get(SAMPLE(logits, tensors, penalties=penalties))
        mro = ModelRunnerOutput()
        if rows.num_drafts is not None:
            collect(runner, rows, result, want_lps, mro)
        else:   # as ModelRunner.collect
            batch.append_sampled(rows, result.token_ids)
            picked = np.flatnonzero(rows.sample)
            mro.sampled = {rows.req_ids[i]: int(result.token_ids[i]) for i in picked}
            if want_lps:
                for i in picked:
                    mro.logprobs[rows.req_ids[i]] = [
                        (result.logprob_token_ids[i], result.logprobs[i],
                         int(result.sampled_rank[i]))]
        for rid, entries in mro.logprobs.items():
            logprobs[rid] += entries
        proposals = None if not spec else ModelRunner._propose(runner, rows) \
            if proposer == "ngram" else propose_close(batch, rows, k)
        sched.update_from_output(out, mro.sampled, proposals)
    if full:
        return [r.output_token_ids for r in reqs], sched, logprobs
    outputs = np.array([r.output_token_ids for r in reqs], np.int64)
    assert outputs.shape == (n, L)
    return outputs, sched


PLAIN = SamplingParams(temperature=0.9, max_tokens=L)
FILTERED = SamplingParams(temperature=0.7, top_k=4, top_p=0.85, max_tokens=L)


@pytest.fixture(scope="module")
def plain_runs():
    """{proposer: (outputs, scheduler)} with speculation, and the outputs without, for
    the same seeds."""
    spec = {p: run(PLAIN, K, proposer=p) for p in ("ngram", "close")}
    base_out, _ = run(PLAIN, 0)
    return spec, base_out


def test_the_harness_exercises_acceptance(plain_runs):
    spec, _ = plain_runs
    for proposer, lo, hi in (("ngram", 0.05, 0.5), ("close", 0.2, 0.9)):
        st = spec[proposer][1].stats()
        # Most requests verified drafts, and both outcomes -- accepted and rejected -- are
        # common at both draft positions.
        assert st.spec_num_drafts > N, proposer
        rate = st.spec_num_accepted_tokens / st.spec_num_draft_tokens
        assert lo < rate < hi, (proposer, rate)
        assert st.spec_accepted_per_pos[1] > 20, proposer
        assert st.num_generation_tokens == N * L
    assert spec["close"][1].stats().spec_accepted_per_pos[1] > N // 20


def test_exact_joint_is_a_distribution():
    for params in (PLAIN, FILTERED):
        joint = exact_joint(params)
        assert joint.shape == (V,) * L and np.isclose(joint.sum(), 1.0)
    # top_k = 4 drops the least likely token of every table row.
    assert (target_probs(TABLES[0], FILTERED) == 0).sum() >= 1


@pytest.mark.parametrize("proposer", ["ngram", "close"])
def test_speculative_output_has_the_target_distribution(plain_runs, proposer):
    spec, base_out = plain_runs
    assert chi_square_p(spec[proposer][0], PLAIN) > 1e-3
    assert chi_square_p(base_out, PLAIN) > 1e-3


@pytest.mark.parametrize("proposer", ["ngram", "close"])
def test_speculative_draws_the_tokens_of_the_plain_path(plain_runs, proposer):
    # Same seed, same tokens: each draw uses the key of its output index, whatever was
    # drafted and accepted.
    spec, base_out = plain_runs
    np.testing.assert_array_equal(spec[proposer][0], base_out)


def test_filtered_sampling_keeps_its_distribution_too():
    spec_out, sched = run(FILTERED, K, seed0=10 ** 6, proposer="close")
    assert sched.stats().spec_accepted_per_pos[1] > N // 40
    assert chi_square_p(spec_out, FILTERED) > 1e-3
    base_out, _ = run(FILTERED, 0, n=2048, seed0=10 ** 6)
    np.testing.assert_array_equal(spec_out[:2048], base_out)


def test_greedy_speculation_is_the_greedy_output():
    greedy = SamplingParams(temperature=0.0, max_tokens=L)
    spec_out, sched = run(greedy, K, n=64)
    base_out, _ = run(greedy, 0, n=64)
    np.testing.assert_array_equal(spec_out, base_out)
    tok = []
    for j in range(L):
        tok.append(int(np.argmax(TABLES[j][prefix_index(np.array([tok + [0] * (L - j)]),
                                                        np.array([j]))[0]])))
    assert (spec_out == tok).all()


def test_per_position_settings_match_the_plain_path():
    # Settings that depend on the token index or the history -- penalties (the history
    # up to each window position), min_tokens' held-back stop tokens, logprobs of each
    # kept token -- give, with speculation, exactly what they give without.
    params = SamplingParams(temperature=0.8, max_tokens=L, seed=0, repetition_penalty=1.4,
                            presence_penalty=0.6, frequency_penalty=0.3, min_tokens=2,
                            stop_token_ids=[4], logprobs=2)
    n = 1024
    spec_out, sched, spec_lps = run(params, K, n=n, seed0=5 * 10 ** 6, proposer="close",
                                    full=True)
    base_out, _, base_lps = run(params, 0, n=n, seed0=5 * 10 ** 6, full=True)
    assert sched.stats().spec_accepted_per_pos[1] > 20
    assert spec_out == base_out
    lengths = [len(o) for o in spec_out]
    assert min(lengths) >= 2 and min(lengths) < L   # some stopped at 4, after min_tokens
    assert all(4 not in o[:2] for o in spec_out)
    for rid, entries in base_lps.items():
        # A verified row's entries run to the token after its accepted drafts; the output
        # processor keeps as many as the scheduler kept tokens (a stop may cut the run).
        n_kept = len(spec_out[int(rid[1:])])
        got = spec_lps[rid][:n_kept]
        assert len(got) == len(entries) == n_kept
        for (ids, lps, rank), (ids2, lps2, rank2) in zip(got, entries):
            np.testing.assert_array_equal(ids, ids2)
            np.testing.assert_array_equal(lps, lps2)
            assert rank == rank2


@pytest.mark.parametrize("variant", ["accept_all", "coin", "argmax", "same_key"])
def test_wrong_verifications_are_detected(variant):
    # The same statistic rejects each wrong verification (so the passing tests above
    # are not passing for lack of power).
    out, _ = run(PLAIN, K, n=N // 2, variant=variant, seed0=2 * 10 ** 6)
    assert chi_square_p(out, PLAIN) < 1e-6


def test_the_harness_verifies_with_num_accepted(monkeypatch):
    # The verification measured above is spec_decode.num_accepted, as
    # ModelRunner._collect_verified (runner/spec_collect.py) calls it.
    import jaxserve.runner.spec_collect as mr
    calls = []

    def counting(sampled, drafts):
        calls.append(len(drafts))
        return num_accepted(sampled, drafts)

    monkeypatch.setattr(mr, "num_accepted", counting)
    _, sched = run(PLAIN, K, n=64, proposer="close")
    assert len(calls) == sched.stats().spec_num_drafts > 0
    assert sum(calls) == sched.stats().spec_num_draft_tokens


def test_chi_square_sees_every_cell():
    # Outputs drawn from the exact joint itself pass; a sample missing its most likely
    # sequence does not.
    joint = exact_joint(PLAIN).reshape(-1)
    draws = np.random.default_rng(3).choice(V ** L, size=N, p=joint)
    outs = np.array(list(itertools.product(range(V), repeat=L)))[draws]
    assert chi_square_p(outs, PLAIN) > 1e-3
    top = np.argmax(joint)
    outs2 = outs[draws != top]
    assert chi_square_p(outs2, PLAIN) < 1e-6
