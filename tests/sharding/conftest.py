"""Sharding fixtures: tiny checkpoints with 8 query heads (so M up to 8 divides them)
and the per-device placement checks shared by the tests."""
from __future__ import annotations

import math
import re

import jax
import numpy as np
import pytest

from models.inputs import ModelInputs
from sharding import MODEL, bytes_per_device
from tests.checkpoints import make_tiny_checkpoint

# KV heads chosen to cover both KV layouts: qwen3 (8) splits on every mesh; llama (4)
# is replicated at M=8 and qwen3_moe (2) at M=4 and M=8.
SHAPES = {
    "llama": dict(num_attention_heads=8, num_key_value_heads=4, intermediate_size=256),
    "qwen3": dict(num_attention_heads=8, num_key_value_heads=8, intermediate_size=256),
    "qwen3_moe": dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=256,
                      num_experts=8, moe_intermediate_size=32),
}
KINDS = tuple(SHAPES)
MESHES = ("1x1", "1x2", "1x4", "1x8", "2x4")
# Parameters small enough to keep whole on every device (the rules table maps no
# axis of theirs to the model axis): norm scales and the MoE router.
REPLICATED_OK = ("scale", "gate")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(kind) -> path of a tiny float32 8-head checkpoint with a tokenizer."""
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            made[kind] = make_tiny_checkpoint(kind, tmp_path_factory.mktemp(f"tp_{kind}"),
                                              **SHAPES[kind])
        return made[kind]
    return get


def replicas(engine) -> list:
    return getattr(engine, "replicas", [engine])


def assert_split_over_model_axis(core) -> None:
    """Each device holds 1/M of every sharded tensor and of the KV cache; what it holds
    whole is only small tensors (norms, router), under 1% of the weights."""
    m = core.mesh.shape[MODEL]
    replicated = sharded = 0
    for path, x in _flat(core.params):
        shard = x.addressable_shards[0].data
        nbytes = x.size * x.dtype.itemsize
        if MODEL in tuple(x.sharding.spec):
            assert shard.size * m == x.size, path
            sharded += nbytes
        else:
            assert m == 1 or path[-1] in REPLICATED_OK or path[-2] in REPLICATED_OK, path
            replicated += nbytes
    assert bytes_per_device(core.params) == sharded // m + replicated
    assert replicated <= 0.01 * (sharded + replicated)
    mc = core.model_config
    for cache in [core.runner.kv_caches["kv"]]:
        shard = cache.addressable_shards[0].data
        stored = cache.shape[1] // 2          # KV heads as stored on this mesh ([P, 2K, S, H])
        assert stored == (mc.num_kv_heads if mc.num_kv_heads % m == 0 else
                          math.lcm(mc.num_kv_heads, m))
        assert shard.shape[1] == 2 * stored // m  # whole (K, V) pairs, only the heads it uses
        assert shard.size * m == cache.size
    if mc.num_kv_heads % m == 0:   # no replication: exactly 1/M of the model's KV cache
        kv_total = sum(c.size * c.dtype.itemsize for c in core.runner.kv_caches.values())
        assert bytes_per_device(core.runner.kv_caches) * m == kv_total


def collectives(hlo: str) -> list[tuple[str, str]]:
    """(result shape, kind) of every collective in compiled HLO text."""
    return re.findall(r"= (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                      r"collective-permute)(?:-start)?\(", hlo)


def assert_step_collectives(core) -> None:
    """The compiled forward step of the largest token bucket: the KV cache never moves
    (attention runs per KV head under shard_map) and no weight is gathered; the only
    collectives are the [T, E] all-reduces after the vocab-parallel embedding and
    after each layer's o_proj and MLP / MoE block."""
    runner, mc = core.runner, core.model_config
    t, rows = runner.token_buckets[-1], runner.batch.max_num_seqs
    z = np.zeros(t, np.int32)
    inputs = ModelInputs(token_ids=z, positions=z, slot_mapping=z,
                         query_start_loc=np.zeros(rows + 1, np.int32),
                         seq_lens=np.zeros(rows, np.int32),
                         page_table=np.zeros((rows, runner.batch.pages_per_req), np.int32),
                         num_seqs=np.zeros(1, np.int32))
    with jax.set_mesh(runner.mesh):
        hlo = runner._forward.lower(runner.params, runner.kv_caches, inputs,
                                    np.zeros(rows, np.int32), runner._no_prev_ids,
                                    np.full(t, -1, np.int32)).compile().as_text()
    ops = collectives(hlo)
    assert ops, "no collectives at all: the step is not sharded"
    assert {kind for _, kind in ops} == {"all-reduce"}, ops
    assert all(shape.startswith(f"f32[{t},{mc.hidden_size}]") for shape, _ in ops), ops
    assert len(ops) == 1 + 2 * mc.num_layers


def _flat(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, prefix + (k,))
        else:
            yield prefix + (k,), v
