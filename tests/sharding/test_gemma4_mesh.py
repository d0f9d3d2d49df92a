"""Gemma 4 on 1x2 and 1x4 meshes: greedy tokens equal transformers' with the sliding
layers' 2 KV heads and the global layers' single KV head replicated as each count needs
(sharding.with_stored_kv_heads), tensor-parallel MoE experts beside the dense MLP, and
per-layer embeddings with KV-sharing layers; every sharded weight holds 1/M per device."""
from __future__ import annotations

import random

import jax
import pytest

from jaxserve import LLM, SamplingParams
from sharding import MODEL
from tests.checkpoints import make_tiny_checkpoint, reference_greedy

NUM_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture
def no_warmup(monkeypatch):
    """Numerics only: compile on first use (test_no_recompile covers warmup)."""
    from jaxserve.runner.model_runner import ModelRunner
    monkeypatch.setattr(ModelRunner, "warmup", lambda self, *a, **k: self.allocate_caches())


# gemma4_moe on both meshes (its sliding KV heads split at 1x2, replicated at 1x4);
# gemma4_e adds per-layer embeddings and KV sharing, which 1x4 checks with every KV
# layout replicated (each engine costs its compilations).
@pytest.mark.parametrize("kind,meshes", [("gemma4_moe", ("1x2", "1x4")),
                                         ("gemma4_e", ("1x4",))])
def test_greedy_identical_on_meshes(kind, meshes, tmp_path, no_warmup):
    path = make_tiny_checkpoint(kind, tmp_path / kind)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (6, 29, 52)]
    expected = reference_greedy(path, prompts, NUM_NEW, kind)
    for mesh in meshes:
        llm = LLM(path, dtype="float32", mesh=mesh, max_model_len=96, max_num_seqs=4,
                  max_num_batched_tokens=32)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, mesh
        m = int(mesh.split("x")[1])
        layout = llm.engine.layout
        # The global layers' own count: 1 KV head on the MoE variant (none of its own on E).
        assert layout.kv_heads == max(2, m)
        assert layout.global_kv_heads == (m if kind == "gemma4_moe" else 0)
        params = jax.tree_util.tree_leaves_with_path(llm.engine.params)
        for key, leaf in params:
            name = jax.tree_util.keystr(key)
            if any(p in name for p in ("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj")):
                shard = leaf.addressable_shards[0].data
                assert shard.size * m == leaf.size, (mesh, name)
        assert MODEL in llm.engine.mesh.axis_names
