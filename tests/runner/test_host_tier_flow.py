"""The host tier's two halves together, as part 2 will drive them (docs/TIERED_CACHE.md):
the scheduler's HostPageIndex decides, the runner's HostCopier copies. Evicted pages
(with a hybrid's snapshot at the end of the last one) go to host; a later prefix found
there comes back into other free pages and state slot, bit for bit; LRU pressure and an
aborted offload keep the index and the arrays consistent."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.core.host_pages import HostPageIndex
from models.layer_stack import CONV, KV, KV_SLIDING, RECURRENT
from tests.runner.test_host_tier import A, D, W, make_tier, random_caches, rows, same


def offload(index, copier, host, caches, evicted, snapshot=None, state_index=None):
    """evicted: (hash, page id) in prefix order; snapshot: (hash, state slot), kept in
    state_index."""
    started = [(index.begin_offload(h), p) for h, p in evicted]
    started = [(e, p) for e, p in started if e is not None]
    state = state_index.begin_offload(snapshot[0]) if snapshot else None
    states = [(snapshot[1], state.slot)] if state is not None else []
    pages = [p for _, p in started]
    pending = copier.offload(caches, {KV: pages, KV_SLIDING: pages},
                             same([e.slot for e, _ in started]), [i for i, _ in states],
                             [h for _, h in states])
    return pending, [e for e, _ in started] + ([state] if state is not None else [])


def test_evicted_prefix_comes_back_from_host():
    caches = random_caches(jnp.bfloat16, np.random.default_rng(0), hybrid=True)
    want = {k: np.array(v) for k, v in caches.items()}
    copier, host = make_tier(caches, slots=4, state_slots=3)
    index, states = HostPageIndex(4), HostPageIndex(3)
    # A three-page prefix (hashes 101..103 on pages 2, 5, 3) is evicted, with the
    # snapshot at its end (state slot 4).
    pending, entries = offload(index, copier, host, caches, [(101, 2), (102, 5), (103, 3)],
                               snapshot=(103, 4), state_index=states)
    assert index.match([101, 102, 103]) == [] and states.lookup(103) is None  # not landed
    pending.land(host)
    index.finish_offload(entries[:3])
    states.finish_offload(entries[3:])

    # A request with that prefix: host hit of three pages and the snapshot.
    hit, state = index.match([101, 102, 103, 104]), states.lookup(103)
    assert [e.page_hash for e in hit] == [101, 102, 103] and state is not None
    index.pin(hit)
    new_pages, new_slot = [6, 1, 4], 2
    caches = copier.restore(caches, host, same([e.slot for e in hit]),
                            {KV: new_pages, KV_SLIDING: new_pages}, [state.slot],
                            [new_slot])
    index.unpin(hit)
    got = {k: np.array(v) for k, v in caches.items()}
    assert rows(got[KV], A, new_pages).tobytes() == rows(want[KV], A, [2, 5, 3]).tobytes()
    assert rows(got[KV_SLIDING], W, new_pages).tobytes() == rows(want[KV_SLIDING], W,
                                                                 [2, 5, 3]).tobytes()
    for kind in (CONV, RECURRENT):
        assert rows(got[kind], D, [new_slot]).tobytes() == rows(want[kind], D, [4]).tobytes()


def test_pressure_and_abort_keep_index_and_arrays_consistent():
    caches = random_caches(jnp.bfloat16, np.random.default_rng(1))
    want = np.array(caches[KV])
    copier, host = make_tier(caches, slots=3)
    index = HostPageIndex(3)                              # two usable slots
    pending, entries = offload(index, copier, host, caches, [(1, 7), (2, 8)])
    pending.land(host)
    index.finish_offload(entries)
    index.lookup(1)                                       # 2 is now the LRU
    pending, entries = offload(index, copier, host, caches, [(3, 9)])   # evicts 2
    index.abort_offload(entries)        # the step failed: its copies are never landed
    del pending
    assert 2 not in index and 3 not in index and index.num_free == 1
    (hit,) = index.match([1])
    assert host.arrays[KV][[hit.slot]].tobytes() == rows(want, A, [7]).tobytes()
