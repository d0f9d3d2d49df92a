"""The host tier's copy programs compiled for TPU v6e by libtpu's deviceless compiler: the
restore writes its pages and state slots into the donated caches in place (no copy of a
cache, no temporary anywhere near a cache's size), and the offload reads only the rows
it names, straight into pinned host memory."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.runner.host_tier import PINNED_HOST, HostCopier, HostTierLayout
from models.layer_stack import CONV, KV, RECURRENT
from pallas_kernels.ragged_paged_attention import KV_HEAD_AXIS
from sharding.parallel import heads_spec
from tests.tpu_compile import compile_on_tpu

pytest.importorskip("libtpu")
from sharding.tpu_targets import abstract_tpu_mesh   # noqa: E402  (after the skip)
from tests.sharding.test_forward_tpu_hlo import whole_cache_copies  # noqa: E402

TARGET = "tpu-v6e"
A, D = 4, 3                       # full-attention and linear-attention layers
PAGES, SLOTS = 16384, 64          # 16-token pages: 256 MiB per layer and KV head pair
# Four KV heads (2K = 8 entries): whole (K, V) pairs split over up to 4 chips.
B, BS = 16, 2                     # pages and state slots per call
CACHES = {KV: jax.ShapeDtypeStruct((A * PAGES, 8, 16, 128), jnp.bfloat16),
          CONV: jax.ShapeDtypeStruct((D * SLOTS, 3 * 1024), jnp.bfloat16),
          RECURRENT: jax.ShapeDtypeStruct((D * SLOTS, 8, 128, 128), jnp.float32)}
KINDS = (KV, CONV, RECURRENT)


def copier() -> HostCopier:
    layout = HostTierLayout.of(CACHES, {KV: A, CONV: D, RECURRENT: D})
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    return HostCopier(layout, {k: cpu for k in KINDS}, pages_per_call=B, states_per_call=BS)


@pytest.mark.parametrize("mesh", ["1x1", "1x4"])
def test_restore_updates_the_caches_in_place(mesh):
    """On one chip, and with the caches split by head over four (each chip writes its
    heads of the pages)."""
    restore = copier().restore_fn

    def flat(kv, conv, rec, page_ids, state_ids, kv_v, conv_v, rec_v):
        out = restore({KV: kv, CONV: conv, RECURRENT: rec},
                      {KV: page_ids, CONV: state_ids, RECURRENT: state_ids},
                      {KV: kv_v, CONV: conv_v, RECURRENT: rec_v})
        return tuple(out[k] for k in KINDS)

    values = [jax.ShapeDtypeStruct((n * CACHES[k].shape[0] // per, *CACHES[k].shape[1:]),
                                   CACHES[k].dtype)
              for k, n, per in ((KV, B, PAGES), (CONV, BS, SLOTS), (RECURRENT, BS, SLOTS))]
    split = {KV: heads_spec(4, KV_HEAD_AXIS), CONV: heads_spec(2, 1), RECURRENT: heads_spec(4, 1)}
    specs = tuple(split[k] for k in KINDS) + (PartitionSpec(),) * 2 + tuple(split[k] for k in KINDS)
    compiled = compile_on_tpu(flat, *(CACHES[k] for k in KINDS),
                              jax.ShapeDtypeStruct((B,), jnp.int32),
                              jax.ShapeDtypeStruct((BS,), jnp.int32), *values,
                              target=TARGET, mesh=mesh, donate_argnums=(0, 1, 2), specs=specs)
    chips = 4 if mesh == "1x4" else 1
    per_chip = {k: (c.shape[0], c.shape[1] // chips, *c.shape[2:]) for k, c in CACHES.items()}
    cache_bytes = {k: CACHES[k].dtype.itemsize * math.prod(s) for k, s in per_chip.items()}
    assert whole_cache_copies(compiled.as_text(), set(per_chip.values())) == []
    ma = compiled.memory_analysis()
    assert ma.alias_size_in_bytes >= sum(cache_bytes.values())   # every cache donated
    # Not even one layer's share of the KV cache is materialised again.
    assert ma.temp_size_in_bytes < cache_bytes[KV] // A, ma.temp_size_in_bytes


def test_the_check_sees_a_restore_without_donation():
    restore = copier().restore_fn
    compiled = compile_on_tpu(
        lambda kv, ids, v: restore({KV: kv}, {KV: ids}, {KV: v})[KV],
        CACHES[KV], jax.ShapeDtypeStruct((B,), jnp.int32),
        jax.ShapeDtypeStruct((B * A, *CACHES[KV].shape[1:]), jnp.bfloat16), target=TARGET)
    ma = compiled.memory_analysis()
    assert ma.alias_size_in_bytes == 0
    assert ma.output_size_in_bytes >= CACHES[KV].dtype.itemsize * math.prod(CACHES[KV].shape)


def test_offload_reads_only_its_pages_into_pinned_host_memory():
    offload = copier().offload_fn
    mesh = abstract_tpu_mesh(TARGET, "1x1")
    rep = NamedSharding(mesh, PartitionSpec())
    args = [jax.ShapeDtypeStruct(CACHES[k].shape, CACHES[k].dtype, sharding=rep) for k in KINDS]
    ids = [jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rep) for n in (B, BS)]

    def flat(kv, conv, rec, page_ids, state_ids):
        out = offload({KV: kv, CONV: conv, RECURRENT: rec},
                      {KV: page_ids, CONV: state_ids, RECURRENT: state_ids})
        return tuple(out[k] for k in KINDS)

    host = rep.with_memory_kind(PINNED_HOST)
    with jax.set_mesh(mesh):
        compiled = jax.jit(flat, out_shardings=(host,) * 3).lower(*args, *ids).compile()
    ma = compiled.memory_analysis()
    row = {k: CACHES[k].dtype.itemsize * math.prod(CACHES[k].shape[1:]) for k in KINDS}
    gathered = B * A * row[KV] + BS * D * (row[CONV] + row[RECURRENT])
    assert ma.host_output_size_in_bytes >= gathered   # the result lands in host memory
    assert ma.temp_size_in_bytes <= 2 * gathered      # staged on device at most once
