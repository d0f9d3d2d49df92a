"""Greedy tokens on every mesh equal transformers' (float32), and the logprobs agree
across meshes: tensor parallelism (1x2, 1x4, 1x8; KV heads split or replicated) and
data parallelism (2x4: two 1x4 replicas behind one front door). Every engine holds
1/M of the weights and KV cache per device; at 1x8 the compiled step has only the
tensor-parallel all-reduces.

qwen3 (8 KV heads, split on every mesh) runs on every mesh; llama and qwen3_moe add only
what they bring: their KV heads replicated at 1x8 (lcm layout), the MoE block's
all-reduce, against their own 1x1 logprobs."""
from __future__ import annotations

import random

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.checkpoints import reference_greedy
from tests.sharding.conftest import (KINDS, MESHES, assert_split_over_model_axis,
                                     assert_step_collectives, replicas)

NUM_NEW = 12
PROMPT_LENS = (5, 20, 33, 70)   # 70 tokens: several pages and prefill chunks of 32


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENS]


def _reference(path: str, prompts: list[list[int]]) -> list[list[int]]:
    return reference_greedy(path, prompts, NUM_NEW)


@pytest.fixture
def no_warmup(monkeypatch):
    """Compile on first use instead of every bucket and sampler up front: these
    tests check numerics, and 15 engines' full warmups would dominate the run
    (test_no_recompile.py checks warmup under a mesh)."""
    from jaxserve.runner.model_runner import ModelRunner
    monkeypatch.setattr(ModelRunner, "warmup", lambda self, *a, **k: self.allocate_caches())


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=3)


def _logprobs(out) -> np.ndarray:
    return np.array([[lp.logprob for lp in sorted(step.values(), key=lambda lp: lp.rank)]
                     for step in out.outputs[0].logprobs])


# The meshes each kind adds beyond the others (every engine costs its compilations).
KIND_MESHES = {"qwen3": MESHES, "llama": ("1x1", "1x8"), "qwen3_moe": ("1x1", "1x8")}
assert set(KIND_MESHES) == set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_identical_on_every_mesh(kind, checkpoint, no_warmup):
    path = checkpoint(kind)
    prompts = _prompts()
    expected = _reference(path, prompts)
    first_lps = None
    for mesh in KIND_MESHES[kind]:
        llm = LLM(path, dtype="float32", mesh=mesh, max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=32)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, mesh
        lps = [_logprobs(o) for o in outs]
        if first_lps is None:
            first_lps = lps
        for a, b in zip(lps, first_lps):
            np.testing.assert_allclose(a, b, atol=2e-5, err_msg=mesh)
        for core in replicas(llm.engine):
            assert_split_over_model_axis(core)
        if mesh == "1x8":
            assert_step_collectives(llm.engine)
        if mesh == "2x4":   # the front door used both replicas
            assert all(core.num_steps > 0 for core in llm.engine.replicas)
