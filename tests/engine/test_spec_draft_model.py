"""Speculative decoding with a draft model (method draft_model): a second checkpoint of
the target's vocabulary drafts k greedy tokens from its own KV cache on the target's
pages. Drafting with the target itself must have every greedy draft accepted (the
drafter computes what the target computes: its catch-up, pages ahead and positions are
right); another random model's drafts are mostly rejected; outputs are the target's
either way, and nothing compiles after warmup."""
from __future__ import annotations

import random

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.errors import ConfigError
from tests.checkpoints import make_tiny_checkpoint
from tests.engine.conftest import assert_no_leaks

ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32,
              compilation_cache_dir=None)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """(target, another random llama of the same vocabulary, a hybrid)."""
    mk = lambda kind, seed: make_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind + str(seed)),
                                                 seed=seed)
    return mk("llama", 0), mk("llama", 5), mk("qwen3_5", 0)


@pytest.fixture(scope="module")
def plain(paths):
    return LLM(paths[0], enforce_eager=True, **ENGINE)


@pytest.fixture(scope="module")
def self_draft(paths):
    """The target drafting for itself (k=3) in a pool of 16 pages, too small for every
    request at once: the parity test's self-draft case and the preemption test share it."""
    return LLM(paths[0], speculative_config={"method": "draft_model", "model": paths[0],
                                             "num_speculative_tokens": 3},
               **{**ENGINE, "num_pages": 17})


def prompts(seed: int, n: int = 6) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(rng.randrange(5, 60))]}
            for _ in range(n)]


def run(llm: LLM, ps, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(ps, params, use_tqdm=False)]


@pytest.mark.parametrize("draft, k", [(0, 3), (1, 2)], ids=["self-draft", "other-draft"])
def test_draft_model_outputs_are_the_targets(paths, plain, self_draft, draft, k):
    spec = self_draft if draft == 0 else LLM(
        paths[0], speculative_config={"method": "draft_model", "model": paths[draft],
                                      "num_speculative_tokens": k}, **ENGINE)
    compiled = spec.engine.num_compilations   # (a process-wide count: spec runs first)
    ps = prompts(k)
    got = run(spec, ps)
    assert spec.engine.num_compilations == compiled, "a program compiled after warmup"
    assert got == run(plain, ps)
    s = spec.engine.scheduler.stats()   # the greedy run's
    assert s.spec_num_drafts > 0 and len(s.spec_accepted_per_pos) == k
    if draft == 0:   # the drafter computes what the target does
        assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens > 50, s
    else:
        assert s.spec_num_accepted_tokens < 0.5 * s.spec_num_draft_tokens, s
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
    assert run(spec, ps, sampled) == run(plain, ps, sampled)
    assert_no_leaks(spec.engine)


def test_draft_models_it_cannot_serve_are_refused(paths, tmp_path):
    target, _, hybrid = paths
    with pytest.raises(ValueError, match="full attention in every layer"):
        LLM(target, speculative_config={"method": "draft_model", "model": hybrid},
            enforce_eager=True, **ENGINE)
    other_vocab = make_tiny_checkpoint("llama", tmp_path / "v", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary has 300 tokens"):
        LLM(target, speculative_config={"method": "draft_model", "model": other_vocab},
            enforce_eager=True, **ENGINE)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        LLM(target, speculative_config={"method": "draft_model", "model": target,
                                        "draft_tensor_parallel_size": 2},
            enforce_eager=True, **ENGINE)
    with pytest.raises(ConfigError, match="needs 'model'"):
        LLM(target, speculative_config={"method": "draft_model"}, **ENGINE)
    with pytest.raises(ValueError, match="no MTP layer"):
        LLM(hybrid, speculative_config={"method": "mtp"}, enforce_eager=True, **ENGINE)


def test_draft_model_under_preemption_and_prefix_hits(plain, self_draft):
    """A pool too small for every request: the drafter's pages ahead are dropped first,
    then requests are preempted and resumed; shared prompts hit the prefix cache (the
    drafter's KV on those pages is the one the first request computed)."""
    spec = self_draft
    assert spec.reset_prefix_cache()
    s0 = spec.engine.scheduler.stats()
    rng = random.Random(3)
    shared = [rng.randrange(3, 250) for _ in range(40)]
    ps = [{"prompt_token_ids": shared + [rng.randrange(3, 250) for _ in range(rng.randrange(3, 30))]}
          for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    assert run(spec, ps, params) == run(plain, ps, params)
    s = spec.engine.scheduler.stats()   # (counts since the engine started: this run's)
    assert s.num_preemptions > s0.num_preemptions, s
    assert s.prefix_cache_hits > s0.prefix_cache_hits, s
    drafted = s.spec_num_draft_tokens - s0.spec_num_draft_tokens
    assert s.spec_num_accepted_tokens - s0.spec_num_accepted_tokens == drafted > 0, s
    assert_no_leaks(spec.engine)
