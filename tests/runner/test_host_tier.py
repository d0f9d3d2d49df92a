"""The host tier's copies on CPU: pages and state slots out to host and back, bit-exact
in every held dtype, into other page ids, in place, the pages not named untouched, and
nothing compiled after the first call of each program."""
from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.compile_counter import num_compilations
from jaxserve.core.sched_output import HostCopies
from jaxserve.runner.host_tier import (HostCopier, HostPageArrays, HostTier, HostTierLayout,
                                       host_memory_kind)
from models.layer_stack import CONV, KV, KV_SLIDING, RECURRENT
from pallas_kernels.held_dtypes import held_dtype

A, W, D = 3, 2, 2                 # full-attention, sliding-window, linear-attention layers
PAGES, SLIDING_PAGES, SLOTS = 12, 7, 6


def random_caches(kv_dtype, rng: np.random.Generator, hybrid: bool = False
                  ) -> dict[str, jax.Array]:
    """Caches in the stacked layout (models/layer_stack.py), random bits in each entry."""
    held = np.dtype(held_dtype(kv_dtype, "cpu"))
    shapes = {KV: ((A * PAGES, 4, 4, 8), held), KV_SLIDING: ((W * SLIDING_PAGES, 2, 4, 16), held)}
    if hybrid:
        shapes |= {CONV: ((D * SLOTS, 24), np.dtype(np.uint16)),       # bf16 conv state
                   RECURRENT: ((D * SLOTS, 2, 4, 4), np.dtype(np.float32))}
    out = {}
    for kind, (shape, dtype) in shapes.items():
        bits = rng.integers(0, 1 << 8 * dtype.itemsize, size=shape, dtype=np.uint64)
        # A committed buffer of XLA's own, as the engine's caches are (jit outputs; a
        # device_put of numpy may alias the numpy memory, which donation cannot reuse).
        out[kind] = jnp.copy(jax.device_put(bits.astype(f"u{dtype.itemsize}").view(dtype),
                                            jax.devices()[0]))
    return out


LAYERS = {KV: A, KV_SLIDING: W, CONV: D, RECURRENT: D}


def make_tier(caches, memory_kind="auto", slots: int = 9, state_slots: int = 4, scales=None):
    layout = HostTierLayout.of(caches, LAYERS)
    if memory_kind == "auto":
        memory_kind = host_memory_kind(jax.devices()[0])
    copier = HostCopier(layout, {k: c.sharding for k, c in caches.items()},
                        pages_per_call=2, states_per_call=1, memory_kind=memory_kind)
    return copier, HostPageArrays(layout, slots, state_slots if CONV in caches else 0, scales)


def same(slots) -> dict:
    """One list of host slots for every KV kind a copy names."""
    return {KV: slots, KV_SLIDING: slots}


def rows(cache: np.ndarray, layers: int, ids) -> np.ndarray:
    per = cache.shape[0] // layers
    return np.stack([cache[[d * per + i for d in range(layers)]] for i in ids])


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8, jnp.float32])
@pytest.mark.parametrize("memory_kind", ["auto", None])
def test_round_trip_is_bit_exact_and_touches_only_the_named_pages(kv_dtype, memory_kind):
    rng = np.random.default_rng(0)
    src = random_caches(kv_dtype, rng, hybrid=True)
    copier, host = make_tier(src, memory_kind)
    want = {k: np.array(v) for k, v in src.items()}
    # Three pages (two calls of two), sliding pages of their own ids, two snapshots.
    pending = copier.offload(src, {KV: [3, 5, 11], KV_SLIDING: [1, 6, 2]}, same([4, 1, 7]),
                             state_ids=[2, 5], host_state_slots=[3, 1])
    pending.land(host)
    # Bits compared (random bits include NaNs).
    assert host.arrays[KV][[4, 1, 7]].tobytes() == rows(want[KV], A, [3, 5, 11]).tobytes()
    assert host.arrays[RECURRENT][[3, 1]].tobytes() == rows(want[RECURRENT], D, [2, 5]).tobytes()

    dst = random_caches(kv_dtype, rng, hybrid=True)
    before = {k: np.array(v) for k, v in dst.items()}
    pointers = {k: v.unsafe_buffer_pointer() for k, v in dst.items()}
    out = copier.restore(dst, host, same([4, 1, 7]), {KV: [8, 2, 9], KV_SLIDING: [5, 3, 4]},
                         host_state_slots=[3, 1], state_ids=[4, 1])
    got = {k: np.array(v) for k, v in out.items()}
    assert {k: v.unsafe_buffer_pointer() for k, v in out.items()} == pointers   # in place
    for kind, layers, to, frm in ((KV, A, [8, 2, 9], [3, 5, 11]),
                                  (KV_SLIDING, W, [5, 3, 4], [1, 6, 2]),
                                  (CONV, D, [4, 1], [2, 5]), (RECURRENT, D, [4, 1], [2, 5])):
        assert got[kind].dtype == want[kind].dtype
        assert rows(got[kind], layers, to).tobytes() == rows(want[kind], layers, frm).tobytes()
        # Everything else is as it was, but the null page / slot 0 padding may write.
        per = got[kind].shape[0] // layers
        keep = [r for r in range(got[kind].shape[0]) if r % per not in (0, *to)]
        assert got[kind][keep].tobytes() == before[kind][keep].tobytes()


def test_nothing_compiles_after_the_first_calls():
    rng = np.random.default_rng(1)
    caches = random_caches(jnp.bfloat16, rng, hybrid=True)
    copier, host = make_tier(caches)
    copier.offload(caches, {KV: [1], KV_SLIDING: [1]}, same([1]), [1], [1]).land(host)
    caches = copier.restore(caches, host, same([1]), {KV: [2]}, [1], [2])
    start = num_compilations()
    for n in (1, 2, 3, 5):
        ids = list(range(1, n + 1))
        copier.offload(caches, {KV: ids}, same(ids), ids[:2], ids[:2]).land(host)
        caches = copier.restore(caches, host, same(ids), {KV: ids, KV_SLIDING: ids}, ids[:1],
                                ids[:1])
    jax.block_until_ready(caches)
    assert num_compilations() == start


def test_a_kind_not_named_is_left_alone():
    """Restoring only the full-attention pages (a sliding page before the window is not
    kept) leaves the sliding cache's real pages as they were."""
    rng = np.random.default_rng(2)
    caches = random_caches(jnp.bfloat16, rng)
    copier, host = make_tier(caches)
    copier.offload(caches, {KV: [3]}, {KV: [2]}).land(host)
    before = np.array(caches[KV_SLIDING])
    out = copier.restore(caches, host, {KV: [2]}, {KV: [5]})
    per = SLIDING_PAGES
    real = [r for r in range(W * per) if r % per]
    assert np.array(out[KV_SLIDING])[real].tobytes() == before[real].tobytes()


def test_restores_under_other_scales_are_refused():
    rng = np.random.default_rng(3)
    caches = random_caches(jnp.int8, rng)
    scales = {"kv_scales": np.full((A, 2, 2), 0.5, np.float32)}
    copier, host = make_tier(caches, scales=scales)
    copier.offload(caches, {KV: [3]}, {KV: [2]}).land(host)
    with pytest.raises(ValueError, match="other KV scales"):
        copier.restore(caches, host, {KV: [2]}, {KV: [5]},
                       kv_scales={"kv_scales": np.full((A, 2, 2), 0.25, np.float32)})
    want = rows(np.array(caches[KV]), A, [3])
    out = copier.restore(caches, host, {KV: [2]}, {KV: [5]}, kv_scales=scales)
    assert rows(np.array(out[KV]), A, [5]).tobytes() == want.tobytes()


def test_the_tier_follows_the_runners_kv_scales():
    """HostTier reads the scales off the runner's params (a getter: they may be replaced):
    the same arrays or equal values are the same scales; other values are a change it
    reports once (the engine then resets both tiers), and until then a restore is refused."""
    rng = np.random.default_rng(5)
    caches = {KV: random_caches(jnp.int8, rng)[KV]}
    layout = HostTierLayout.of(caches, LAYERS)
    params = {"w": jnp.zeros(3), "kv_scales": jnp.full((A, 4, 2), 0.5, jnp.float32)}
    runner = SimpleNamespace(params=params)
    tier = HostTier(caches, LAYERS, 8 * layout.page_bytes, jax.devices()[0],
                    lambda: runner.params)
    caches = tier.warmup(caches)
    assert tier.restore_call_s > 0   # timed once compiled (the engine's cost model)
    assert set(tier.kv_scales()) == {"kv_scales"}
    caches, pending = tier.dispatch(caches, HostCopies(offload_pages=[3], offload_slots=[2]))
    pending.land(tier.arrays)
    restore = HostCopies(restore_slots=[2], restore_pages=[5])
    runner.params = {**params, "kv_scales": jnp.full((A, 4, 2), 0.5, jnp.float32)}
    assert not tier.follow_scales()   # equal values: the same scales
    caches, _ = tier.dispatch(caches, restore)
    runner.params = {**params, "kv_scales": jnp.full((A, 4, 2), 0.25, jnp.float32)}
    with pytest.raises(ValueError, match="other KV scales"):
        tier.dispatch(caches, restore)
    assert tier.follow_scales() and not tier.follow_scales()   # reported once
    np.testing.assert_array_equal(tier.arrays.kv_scales["kv_scales"], 0.25)
    caches, _ = tier.dispatch(caches, restore)   # (what the reset tiers store from now)


def test_layout_bytes_and_bad_calls():
    caches = random_caches(jnp.bfloat16, np.random.default_rng(4), hybrid=True)
    layout = HostTierLayout.of(caches, LAYERS)
    assert layout.page_bytes == 2 * A * 4 * 4 * 8
    assert layout.sliding_page_bytes == 2 * W * 2 * 4 * 16
    assert layout.state_bytes == D * (24 * 2 + 2 * 4 * 4 * 4)
    copier, host = make_tier(caches)
    with pytest.raises(ValueError, match="2 page ids for 1 host slots"):
        copier.offload(caches, {KV: [1, 2]}, {KV: [1]})
    with pytest.raises(ValueError, match="'conv'"):
        copier.offload(caches, {CONV: [1]}, {CONV: [1]})
    llama = {KV: caches[KV]}
    copier, _ = make_tier(llama)
    with pytest.raises(ValueError, match="without recurrent state"):
        copier.offload(llama, {KV: [1]}, {KV: [1]}, [1], [1])


def test_an_offload_reads_the_pages_before_a_later_restore_rewrites_them():
    """The gather is dispatched in order with later programs: landing it after a restore
    (donating the caches) has overwritten the page still stores the page as it was."""
    rng = np.random.default_rng(5)
    caches = random_caches(jnp.bfloat16, rng)
    copier, host = make_tier(caches)
    old = rows(np.array(caches[KV]), A, [3])
    copier.offload(caches, {KV: [4]}, {KV: [2]}).land(host)            # other bits in slot 2
    pending = copier.offload(caches, {KV: [3]}, {KV: [5]})
    caches = copier.restore(caches, host, {KV: [2]}, {KV: [3]})         # page 3 rewritten
    assert rows(np.array(caches[KV]), A, [3]).tobytes() != old.tobytes()
    pending.land(host)
    assert host.arrays[KV][[5]].tobytes() == old.tobytes()


def test_caches_split_by_head_over_a_mesh_round_trip():
    """Tensor parallelism: each device copies its own heads; the caches keep their
    shardings and buffers."""
    from jax.sharding import NamedSharding
    from sharding.mesh import make_mesh
    from sharding.parallel import heads_spec
    mesh = make_mesh("1x2")
    rng = np.random.default_rng(6)
    caches = random_caches(jnp.bfloat16, rng, hybrid=True)
    axis = {KV: 1, KV_SLIDING: 1, CONV: 1, RECURRENT: 1}
    caches = {k: jax.device_put(v, NamedSharding(mesh, heads_spec(v.ndim, axis[k])))
              for k, v in caches.items()}
    caches = jax.jit(lambda c: jax.tree.map(jnp.copy, c))(caches)   # XLA's own buffers
    copier, host = make_tier(caches)
    want = {k: np.array(v) for k, v in caches.items()}
    shardings = {k: v.sharding for k, v in caches.items()}
    copier.offload(caches, {KV: [1, 2], KV_SLIDING: [3, 4]}, same([1, 2]), [1], [1]).land(host)
    out = copier.restore(caches, host, same([1, 2]), {KV: [5, 6], KV_SLIDING: [5, 6]}, [1],
                         [3])
    assert {k: v.sharding for k, v in out.items()} == shardings
    got = {k: np.array(v) for k, v in out.items()}
    assert rows(got[KV], A, [5, 6]).tobytes() == rows(want[KV], A, [1, 2]).tobytes()
    assert rows(got[KV_SLIDING], W, [5, 6]).tobytes() == rows(want[KV_SLIDING], W, [3, 4]).tobytes()
    assert rows(got[RECURRENT], D, [3]).tobytes() == rows(want[RECURRENT], D, [1]).tobytes()


def test_an_offload_stores_only_the_kinds_it_names():
    rng = np.random.default_rng(7)
    caches = random_caches(jnp.bfloat16, rng)
    copier, host = make_tier(caches)
    copier.offload(caches, {KV: [3], KV_SLIDING: [4]}, same([2])).land(host)
    sliding = host.arrays[KV_SLIDING][2].copy()
    copier.offload(caches, {KV: [5]}, {KV: [2]}).land(host)
    assert host.arrays[KV][[2]].tobytes() == rows(np.array(caches[KV]), A, [5]).tobytes()
    assert host.arrays[KV_SLIDING][2].tobytes() == sliding.tobytes()


def test_arrays_sized_from_bytes_stay_within_them():
    caches = random_caches(jnp.bfloat16, np.random.default_rng(8), hybrid=True)
    layout = HostTierLayout.of(caches, LAYERS)
    budget = 40 * (layout.page_bytes + layout.sliding_page_bytes) + 20 * layout.state_bytes
    host = HostPageArrays.for_budget(layout, budget, sliding_per_page=1.0)
    assert sum(a.nbytes for a in host.arrays.values()) <= budget
    assert host.num_slots > 2 and host.num_state_slots >= 2
    assert host.num_slots == host.arrays[KV].shape[0] == host.arrays[KV_SLIDING].shape[0]
    # Fewer sliding slots than page slots (a prefix needs only its window's): more pages.
    fewer = HostPageArrays.for_budget(layout, budget, sliding_per_page=0.25)
    assert sum(a.nbytes for a in fewer.arrays.values()) <= budget
    assert fewer.num_slots > host.num_slots
    assert fewer.num_sliding_slots == int(fewer.num_slots * 0.25) >= 2
    # By default as many bytes of sliding pages as of pages (core/host_pages.py).
    even = HostPageArrays.for_budget(layout, budget)
    assert even.num_sliding_slots == int(even.num_slots * min(
        1.0, layout.page_bytes / layout.sliding_page_bytes))
    with pytest.raises(ValueError, match="holds no page"):
        HostPageArrays.for_budget(layout, layout.page_bytes)


def test_a_restore_is_sent_in_its_dispatch_and_scattered_first_in_the_next():
    """HostTier.dispatch sends a restore's rows without touching the caches (the step's
    forward does not wait for them); the next dispatch scatters them first, before its own
    offloads (which read the restored page as restored), with the rows as they were sent
    (their host slot rewritten since); nothing compiles after warmup."""
    rng = np.random.default_rng(6)
    caches = {KV: random_caches(jnp.bfloat16, rng)[KV]}
    tier = HostTier(caches, LAYERS, 8 * HostTierLayout.of(caches, LAYERS).page_bytes,
                    jax.devices()[0])
    caches = tier.warmup(caches)
    start = num_compilations()
    want = rows(np.array(caches[KV]), A, [3])
    caches, pending = tier.dispatch(caches, HostCopies(offload_pages=[3], offload_slots=[2]))
    pending.land(tier.arrays)
    before = np.array(caches[KV])
    caches, _ = tier.dispatch(caches, HostCopies(restore_slots=[2], restore_pages=[5]))
    assert np.array(caches[KV]).tobytes() == before.tobytes()   # sent, not scattered
    assert tier.log[-1] == (2, "send", (5,))
    tier.arrays.arrays[KV][2] = 0   # the slot reused before the scatter
    caches, pending = tier.dispatch(caches, HostCopies(offload_pages=[5], offload_slots=[4]))
    assert list(tier.log) == [(2, "send", (5,)), (3, "scatter", (5,))]
    pending.land(tier.arrays)
    assert rows(np.array(caches[KV]), A, [5]).tobytes() == want.tobytes()
    assert tier.arrays.arrays[KV][[4]].tobytes() == want.tobytes()
    assert num_compilations() == start
