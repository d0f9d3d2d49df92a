"""The host tier's bookkeeping: slots, LRU eviction, pins while copies are in flight,
reset, and sizing from bytes (a hybrid's state snapshots have an index of their own:
tests/core/test_host_cache.py)."""
from __future__ import annotations

import pytest

from jaxserve.core.host_pages import HostPageIndex, size_host_tier


def offloaded(index: HostPageIndex, *hashes: int) -> list:
    pages = [index.begin_offload(h) for h in hashes]
    index.finish_offload(pages)
    return pages


def test_slots_are_distinct_and_never_the_dummy():
    index = HostPageIndex(5)
    pages = offloaded(index, 10, 11, 12, 13)
    assert sorted(p.slot for p in pages) == [1, 2, 3, 4]
    assert index.num_free == 0 and len(index) == 4


def test_an_entry_is_visible_only_once_its_copy_landed():
    index = HostPageIndex(4)
    page = index.begin_offload(7)
    assert page.pins == 1 and index.lookup(7) is None and 7 in index
    assert index.begin_offload(7) is None            # in flight: nothing more to copy
    index.finish_offload([page])
    assert index.lookup(7) is page and page.pins == 0


def test_abort_drops_the_entry_and_frees_its_slot():
    index = HostPageIndex(3)
    page = index.begin_offload(7)
    index.abort_offload([page])
    assert 7 not in index and index.num_free == 2
    assert index.begin_offload(8).slot == page.slot   # the freed slot is reused


def test_lru_evicts_the_least_recently_used():
    index = HostPageIndex(4)   # three usable slots
    offloaded(index, 1, 2, 3)
    index.lookup(1)            # 2 is now the least recently used
    new = index.begin_offload(4)
    assert 2 not in index and {1, 3, 4} <= set(index._lru) and index.num_evicted == 1
    index.finish_offload([new])


def test_pinned_entries_are_not_evicted_and_a_full_pinned_tier_refuses():
    index = HostPageIndex(3)
    a, b = offloaded(index, 1, 2)
    index.pin([a, b])
    assert index.begin_offload(3) is None            # no room: every entry is pinned
    index.unpin([a])
    assert index.begin_offload(3) is not None and 1 not in index and 2 in index


def test_match_is_the_longest_landed_run_from_the_start():
    index = HostPageIndex(8)
    offloaded(index, 1, 2, 4)
    index.begin_offload(3)                           # in flight: ends the run
    assert [p.page_hash for p in index.match([1, 2, 3, 4])] == [1, 2]
    assert index.match([9, 1]) == []


def test_reset_forgets_all_and_a_pinned_slot_returns_at_its_last_unpin():
    index = HostPageIndex(4)
    a, b = offloaded(index, 1, 2)
    index.pin([a])
    index.reset()
    assert len(index) == 0 and index.lookup(1) is None and index.lookup(2) is None
    assert index.num_free == 2                       # b's slot, and the unused one
    with pytest.raises(ValueError, match="not restorable"):
        index.pin([a])
    index.unpin([a])
    assert index.num_free == 3


def test_a_copy_landing_after_reset_does_not_come_back():
    index = HostPageIndex(4)
    page = index.begin_offload(1)
    index.reset()
    index.finish_offload([page])
    assert index.lookup(1) is None and index.num_free == 3


def test_unbalanced_unpin_is_refused():
    index = HostPageIndex(3)
    page = offloaded(index, 1)[0]
    with pytest.raises(ValueError, match="not pinned"):
        index.unpin([page])


@pytest.mark.parametrize("slots", [1, 0, -1])
def test_bad_slot_counts_are_refused(slots):
    with pytest.raises(ValueError, match="needs >= 2 slots"):
        HostPageIndex(slots)


def test_sizing_from_bytes():
    assert size_host_tier(10 * 100, 100) == (10, 0)
    assert size_host_tier(10 * 100 + 99, 100) == (10, 0)
    # A hybrid: the state share in whole snapshots, the rest in pages.
    assert size_host_tier(10_000, 100, state_bytes=400, state_share=0.2) == (80, 5)
    assert size_host_tier(150, 100) == (0, 0)        # not even one page beside the dummy
    assert size_host_tier(10_000, 100, state_bytes=4_000, state_share=0.5) == (0, 0)
    with pytest.raises(ValueError):
        size_host_tier(1000, 0)
