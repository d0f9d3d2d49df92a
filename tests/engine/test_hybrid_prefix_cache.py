"""Prefix caching on Qwen3.5 hybrids (dense and MoE): a hit restores the recurrent
state snapshot at its end, so greedy tokens are those of the same engine without the
cache, while shared system prompts and the turns of a chat are computed once."""
from __future__ import annotations

import random

import pytest

from jaxserve import LLM, SamplingParams
from tests.checkpoints import HYBRID_KINDS, make_tiny_checkpoint
from tests.engine.conftest import assert_no_leaks

PS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def engine(path: str, caching: bool, **kw) -> LLM:
    """These tests check tokens and cache hits, not compilation (test_no_recompile.py
    checks a hybrid's warmup): every engine skips warmup and compiles what its requests
    use (enforce_eager)."""
    kw = {"dtype": "float32", "max_model_len": 704, "max_num_seqs": 4,
          "max_num_batched_tokens": 128, "page_size": PS, "enforce_eager": True, **kw}
    return LLM(path, enable_prefix_caching=caching, compilation_cache_dir=None, **kw)


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def run(llm: LLM, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], [o.num_cached_tokens for o in outs]


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    """kind -> a tiny checkpoint with room for a system prompt of over 512 tokens."""
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            made[kind] = make_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind),
                                              max_position_embeddings=1024)
        return made[kind]
    return get


@pytest.fixture(scope="module")
def engines(long_checkpoint):
    """(kind, caching) -> an engine of `engine`'s defaults, built once for the module."""
    made: dict[tuple[str, bool], LLM] = {}

    def get(kind: str, caching: bool) -> LLM:
        if (kind, caching) not in made:
            made[kind, caching] = engine(long_checkpoint(kind), caching)
        return made[kind, caching]
    return get


@pytest.fixture(scope="module", params=HYBRID_KINDS)
def pair(request, engines):
    """(cached engine, uncached engine) of one kind."""
    return engines(request.param, True), engines(request.param, False)


@pytest.mark.parametrize("system_len", [40, 530])
def test_shared_system_prompt(pair, system_len):
    cached, plain = pair
    rng = random.Random(system_len)
    system = toks(rng, system_len)
    prompts = [system + toks(rng, rng.randrange(3, 30)) for _ in range(5)]
    want, _ = run(plain, prompts)   # (the uncached engine's tokens: batched, no hits)
    got, hits = [], []
    for p in prompts:   # one after another, as the requests of a server arrive
        g, h = run(cached, [p])
        got.append(g[0])
        hits.append(h[0])
    assert got == want
    shared = system_len // PS * PS
    assert hits[0] == hits[1] == 0 or system_len < PS
    # From the third request on the shared prefix is reused to within a page.
    assert all(h >= shared - PS for h in hits[2:]), hits
    assert_no_leaks(cached.engine)


def test_multi_turn_chat_reuses_the_previous_turn(pair):
    cached, plain = pair
    rng = random.Random(7)
    history: list[int] = toks(rng, 37)
    stats0 = cached.engine.scheduler.stats()
    all_hits = 0
    for turn in range(4):
        want, _ = run(plain, [history])
        got, hits = run(cached, [history])
        assert got == want, turn
        if turn:
            # All of the previous turn (its prompt and its answer) to within a page.
            assert hits[0] >= previous - PS, (turn, hits, previous)
        all_hits += hits[0]
        previous = len(history) + len(got[0][0]) - 1   # (the last token was not computed)
        history = history + got[0][0] + toks(rng, rng.randrange(5, 20))
    # The prefix-cache metrics count the hybrid's hits as they are.
    stats = cached.engine.scheduler.stats()
    assert stats.prefix_cache_hits - stats0.prefix_cache_hits == all_hits > 0
    assert_no_leaks(cached.engine)


def test_prompts_branching_at_random_positions_in_one_batch(pair):
    cached, plain = pair
    rng = random.Random(3)
    root = toks(rng, 200)
    prompts = [root[:rng.randrange(10, 200)] + toks(rng, rng.randrange(1, 40))
               for _ in range(10)]
    want, _ = run(plain, prompts)
    for _ in range(2):   # the second time round, everything is cached
        got, _ = run(cached, prompts)
        assert got == want
    assert_no_leaks(cached.engine)


def test_n_greater_than_one_and_sampling(pair):
    cached, plain = pair
    rng = random.Random(5)
    prompt = toks(rng, 90)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    want, _ = run(plain, [prompt], params)
    for _ in range(2):
        got, _ = run(cached, [prompt], params)
        assert got == want
    assert_no_leaks(cached.engine)


def test_preemption_in_the_middle(long_checkpoint, engines):
    rng = random.Random(9)
    system = toks(rng, 50)
    prompts = [system + toks(rng, rng.randrange(20, 60)) for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # The tokens of the uncached engine, which has pages enough for all four at once.
    want, _ = run(engines("qwen3_5", False), prompts, params)
    small = dict(num_pages=22, max_model_len=160, max_num_batched_tokens=64)
    cached = engine(long_checkpoint("qwen3_5"), True, **small)
    run(cached, prompts[:1], params)   # its pages and snapshots are cached first
    got, hits = run(cached, prompts, params)
    assert cached.engine.scheduler.num_preemptions > 0
    assert got == want
    assert_no_leaks(cached.engine)


def test_data_parallel_replicas(long_checkpoint, engines):
    """Two replicas (mesh 2x1), each with its own snapshots: a shared system prompt."""
    rng = random.Random(13)
    system = toks(rng, 70)
    prompts = [system + toks(rng, rng.randrange(3, 20)) for _ in range(8)]
    want, _ = run(engines("qwen3_5", False), prompts)
    dp = engine(long_checkpoint("qwen3_5"), True, mesh="2x1")
    got, hits = [], []
    for p in prompts:
        g, h = run(dp, [p])
        got += g
        hits += h
    assert got == want
    assert max(hits) >= 64
