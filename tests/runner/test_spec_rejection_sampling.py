"""Speculative decoding keeps the target's distribution (temperature > 0), measured.

A toy "model" over a tiny vocabulary: the logits of the j-th output token are a fixed
random table indexed by the outputs before it. Thousands of seeded requests run through
the real host-side path -- Scheduler (num_speculative_tokens), InputBatch (drafts written
after the known tokens, the sampler's window rows and their steps), the jitted sampler,
ModelRunner._collect_verified (num_accepted) and ModelRunner._propose (ngram prompt
lookup, whose drafts are deliberately unrelated to the toy's distribution) -- and the
empirical joint distribution of the 4 output tokens is compared with the exact one
(softmax(logits / T), top_k / top_p applied) by a chi-square test. Negative controls
(wrong verifications) run through the same harness and must be rejected by the same
statistic, so the test is known to have the power to see a wrong implementation.

Exactness is also checked directly: a seeded request draws, with speculation, the very
tokens it draws without (each token's key is fold_in(seed, its output index)).
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from scipy import stats

from jaxserve.core.request import Request
from jaxserve.core.scheduler import Scheduler
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.model_runner import ModelRunner, ModelRunnerOutput
from jaxserve.runner.sampler import sample
from jaxserve.runner.spec_decode import num_accepted
from jaxserve.sampling_params import SamplingParams
from jaxserve.speculative import SpeculativeConfig

V = 5            # vocabulary
L = 4            # output tokens per request (max_tokens)
K = 2            # drafts per step
PS, MML = 8, 32
# Every token occurs in the prompt, so a 1-gram lookup always proposes something.
PROMPT = [0, 1, 2, 3, 4, 0, 2, 4, 1, 3, 0, 3]
N = 8192         # requests (seeds) per run

SAMPLE = jax.jit(sample)

rng = np.random.default_rng(1234)
# TABLES[j][index of the j previous outputs] -> logits of output j.
TABLES = [rng.normal(size=(V ** j, V)).astype(np.float32) * 1.5 for j in range(L)]


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
            probs = runner.probs[first:first + k + 1]
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


def run(params: SamplingParams, k: int, n: int = N, seed0: int = 0,
        variant: str | None = None) -> tuple[np.ndarray, Scheduler]:
    """n requests with seeds seed0.. generate L tokens each; k drafts a step (0: no
    speculation). -> (outputs [n, L], the scheduler)."""
    sched = Scheduler(num_pages=n * (-(-MML // PS)) + 1, page_size=PS, max_num_seqs=n,
                      max_num_batched_tokens=n * MML, max_model_len=MML,
                      num_speculative_tokens=k)
    batch = InputBatch(max_num_seqs=n, max_model_len=MML, page_size=PS, token_buckets=(16,),
                       vocab_size=V, num_speculative_tokens=k)
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1,
                             prompt_lookup_max=2) if k else None
    runner = SimpleNamespace(batch=batch, spec=spec, probs=None)
    reqs = []
    for i in range(n):
        r = Request(f"r{i}", PROMPT, SamplingParams(**_fields(params), seed=seed0 + i),
                    eos_token_id=None, page_size=PS)
        sched.add_request(r)
        reqs.append(r)
    num_rows = batch.max_sample_rows
    collect = ModelRunner._collect_verified if variant in (None, "same_key") else \
        collect_verified_variant(variant)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        rows = batch.update(out, ())
        tensors = batch.sampling_tensors(rows, num_rows, penalties=False, penalty_len=MML)
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
        logits = np.zeros((num_rows, V), np.float32)
        logits[:len(prow)] = toy_logits(outputs, np.minimum(depth, L - 1))
        runner.probs = target_probs(logits[:len(prow)], params)
        result = jax.device_get(SAMPLE(logits, tensors))
        mro = ModelRunnerOutput()
        if rows.num_drafts is not None:
            collect(runner, rows, result, False, mro)
        else:   # as ModelRunner.collect
            batch.append_sampled(rows, result.token_ids)
            picked = np.flatnonzero(rows.sample)
            mro.sampled = {rows.req_ids[i]: int(result.token_ids[i]) for i in picked}
        proposals = ModelRunner._propose(runner, rows) if spec else None
        sched.update_from_output(out, mro.sampled, proposals)
    outputs = np.array([r.output_token_ids for r in reqs], np.int64)
    assert outputs.shape == (n, L)
    return outputs, sched


def _fields(params: SamplingParams) -> dict:
    return dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                max_tokens=L, ignore_eos=True)


PLAIN = SamplingParams(temperature=0.9, max_tokens=L)
FILTERED = SamplingParams(temperature=0.7, top_k=4, top_p=0.85, max_tokens=L)


@pytest.fixture(scope="module")
def plain_runs():
    spec_out, sched = run(PLAIN, K)
    base_out, _ = run(PLAIN, 0)
    return spec_out, base_out, sched


def test_the_harness_exercises_acceptance(plain_runs):
    _, _, sched = plain_runs
    st = sched.stats()
    # Most requests verified drafts, and a fair share of them were accepted (both paths
    # -- accepted and rejected -- at both positions).
    assert st.spec_num_drafts > N
    rate = st.spec_num_accepted_tokens / st.spec_num_draft_tokens
    assert 0.1 < rate < 0.9, rate
    assert st.spec_accepted_per_pos[1] > N // 50
    assert st.num_generation_tokens == N * L


def test_exact_joint_is_a_distribution():
    for params in (PLAIN, FILTERED):
        joint = exact_joint(params)
        assert joint.shape == (V,) * L and np.isclose(joint.sum(), 1.0)
    # top_k = 4 drops the least likely token of every table row.
    assert (target_probs(TABLES[0], FILTERED) == 0).sum() >= 1


def test_speculative_output_has_the_target_distribution(plain_runs):
    spec_out, base_out, _ = plain_runs
    assert chi_square_p(spec_out, PLAIN) > 1e-3
    assert chi_square_p(base_out, PLAIN) > 1e-3


def test_speculative_draws_the_tokens_of_the_plain_path(plain_runs):
    # Same seed, same tokens: each draw uses the key of its output index.
    spec_out, base_out, _ = plain_runs
    np.testing.assert_array_equal(spec_out, base_out)


def test_filtered_sampling_keeps_its_distribution_too():
    spec_out, sched = run(FILTERED, K, seed0=10 ** 6)
    assert sched.stats().spec_num_accepted_tokens > N // 10
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


@pytest.mark.parametrize("variant", ["accept_all", "coin", "argmax", "same_key"])
def test_wrong_verifications_are_detected(variant):
    # The same statistic rejects each wrong verification (so the passing tests above
    # are not passing for lack of power).
    out, _ = run(PLAIN, K, variant=variant, seed0=2 * 10 ** 6)
    assert chi_square_p(out, PLAIN) < 1e-6


def test_num_accepted_is_the_verification_used():
    # Sanity link: the harness's verification is _collect_verified, which calls
    # spec_decode.num_accepted on the window's draws and the row's drafts.
    assert num_accepted(np.array([3, 1, 4]), np.array([3, 1])) == 2
    assert ModelRunner._collect_verified.__module__ == "jaxserve.runner.model_runner"


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
