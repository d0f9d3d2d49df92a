"""The Pallas attention kernels under the model-axis shard_map still lower for
"cuda" and "tpu" (from this CPU machine): each device's kernel sees its own KV
heads (here 8 KV heads over 8 devices: 1 head, 4 query heads each)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.sharding import NamedSharding, PartitionSpec

from models.inputs import ModelInputs
from models.layers import paged_attention
from sharding import heads_spec, make_mesh

T, R, PAGES_PER_REQ, K, G, H, S, NUM_PAGES = 64, 8, 6, 8, 4, 128, 16, 32
MARKER = {"cuda": "mosaic_gpu", "tpu": "tpu_custom_call"}


def _attend(q, k, v, cache, slots, seq_lens, page_table, query_start_loc, num_seqs):
    inputs = ModelInputs(token_ids=slots, positions=slots, slot_mapping=slots,
                         query_start_loc=query_start_loc, seq_lens=seq_lens,
                         page_table=page_table, num_seqs=num_seqs)
    return paged_attention(q, k, v, cache, inputs, sm_scale=H ** -0.5, backend="pallas")


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_sharded_pallas_attention_exports(platform):
    mesh = make_mesh("1x8")
    rep = NamedSharding(mesh, PartitionSpec())
    heads = NamedSharding(mesh, heads_spec(3, 1))
    kv = NamedSharding(mesh, heads_spec(4, 1))
    bf16, i32 = jnp.bfloat16, jnp.int32
    spec = lambda shape, dtype, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    args = (spec((T, K * G, H), bf16, heads), spec((T, K, H), bf16, heads),
            spec((T, K, H), bf16, heads), spec((NUM_PAGES, 2 * K, S, H), bf16, kv),
            spec((T,), i32, rep), spec((R,), i32, rep), spec((R, PAGES_PER_REQ), i32, rep),
            spec((R + 1,), i32, rep), spec((1,), i32, rep))
    with jax.set_mesh(mesh):
        exported = export.export(jax.jit(_attend), platforms=[platform])(*args)
    text = exported.mlir_module()
    assert exported.nr_devices == 8
    assert MARKER[platform] in text
    assert "all_gather" not in text and "all-gather" not in text
