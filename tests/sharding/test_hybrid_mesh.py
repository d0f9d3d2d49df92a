"""Qwen3.5 hybrids under tensor parallelism: greedy tokens on 1x2 and 1x4 equal
transformers' (float32); every device holds 1/M of the weights, of the KV cache and
of the recurrent state (DeltaNet key-head groups split over the model axis); the
compiled step moves no state and gathers no weight: its only collectives are the
[T, E] all-reduces after the embedding and after each layer's mixer and MLP."""
from __future__ import annotations

import random
import re

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from models.inputs import ModelInputs
from sharding import MODEL
from tests.checkpoints import make_tiny_checkpoint, reference_greedy
from tests.sharding.conftest import _flat, collectives

SHAPE = dict(num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4,
             linear_num_value_heads=8)
NUM_NEW = 12
PROMPT_LENS = (5, 70, 130)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
# Small enough to keep whole on every device: norms, the routers, the shared-expert gate.
REPLICATED_OK = ("scale", "offset_scale", "gate", "shared_expert_gate")


def _prompts() -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENS]




def _assert_split(core) -> None:
    m = core.mesh.shape[MODEL]
    for path, x in _flat(core.params):
        if MODEL in tuple(x.sharding.spec):
            assert x.addressable_shards[0].data.size * m == x.size, path
        else:
            assert path[-1] in REPLICATED_OK or path[-2] in REPLICATED_OK, path
    for cache in jax.tree_util.tree_leaves(core.runner.kv_caches):   # KV caches and states
        assert cache.addressable_shards[0].data.size * m == cache.size


def _assert_step_collectives(core) -> None:
    runner, mc = core.runner, core.model_config
    t, rows = runner.token_buckets[-1], runner.batch.max_num_seqs
    z = np.zeros(t, np.int32)
    inputs = ModelInputs(token_ids=z, positions=z, slot_mapping=z,
                         query_start_loc=np.zeros(rows + 1, np.int32), seq_lens=np.zeros(rows, np.int32),
                         page_table=np.zeros((rows, runner.batch.pages_per_req), np.int32),
                         num_seqs=np.zeros(1, np.int32), state_slots=np.zeros(rows, np.int32))
    with jax.set_mesh(runner.mesh):
        hlo = runner._forward.lower(runner.params, runner.kv_caches, inputs,
                                    np.zeros(rows, np.int32), runner._no_prev_ids,
                                    np.full(t, -1, np.int32)).compile().as_text()
    assert {kind for _, kind in collectives(hlo)} <= {"all-reduce"}
    # XLA may combine independent all-reduces (the MoE's routed and shared experts) into
    # one with a tuple of operands: read each op's whole result shape.
    ops = re.findall(r"= (\([^)]*\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                     r"collective-permute)(?:-start)?\(", hlo)
    assert {kind for _, kind in ops} == {"all-reduce"}, ops
    operands = [s for shape, _ in ops for s in re.findall(r"\w+\[[^\]]*\]", shape)]
    assert all(s == f"f32[{t},{mc.hidden_size}]" for s in operands), ops
    assert len(ops) == 1 + 2 * mc.num_layers, ops


# qwen3_5 on both meshes (its 2 KV heads split at 1x2, replicated at 1x4); qwen3_5_moe
# adds the routed and shared experts under tensor parallelism, which 1x4 checks with the
# step's collectives (each engine costs its compilations).
@pytest.mark.parametrize("kind,meshes", [("qwen3_5", ("1x2", "1x4")),
                                         ("qwen3_5_moe", ("1x4",))])
def test_greedy_identical_on_1x2_and_1x4(kind, meshes, tmp_path, monkeypatch):
    from jaxserve.runner.model_runner import ModelRunner
    # numerics only: no warmup (the caches it would allocate after compiling, at once)
    monkeypatch.setattr(ModelRunner, "warmup", lambda self, *a, **k: self.allocate_caches())
    path = make_tiny_checkpoint(kind, tmp_path / kind, **SHAPE)
    prompts = _prompts()
    expected = reference_greedy(path, prompts, NUM_NEW, kind)
    for mesh in meshes:
        llm = LLM(path, dtype="float32", mesh=mesh, max_model_len=256, max_num_seqs=4,
                  max_num_batched_tokens=64)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, mesh
        _assert_split(llm.engine)
        if mesh == "1x4":
            _assert_step_collectives(llm.engine)
