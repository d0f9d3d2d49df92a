"""LoRA slot manager (LRU + reference counts) and the host-side adapter cache."""
from __future__ import annotations

import pytest

from jaxserve.core.lora_slots import AdapterCache, LoRASlotManager, SlotGrant


def test_free_slots_first_then_lru_unpinned_evicted():
    m = LoRASlotManager(2)
    assert m.acquire("a") == SlotGrant(1, load=True)
    assert m.acquire("b") == SlotGrant(2, load=True)
    assert m.acquire("a") == SlotGrant(1, load=False)   # resident: no load, now most recent
    for _ in range(2):
        m.release("a")
    m.release("b")
    # Both unpinned; b is the least recently used.
    assert m.acquire("c") == SlotGrant(2, load=True, evicted="b")
    assert m.resident == ["a", "c"] and m.slot_of("b") is None
    m.release("c")
    assert m.acquire("b") == SlotGrant(1, load=True, evicted="a")


def test_pinned_adapters_are_never_evicted_and_requests_wait():
    m = LoRASlotManager(2)
    m.acquire("a"), m.acquire("b")
    assert m.acquire("c") is None                      # all pinned: wait
    assert m.resident == ["a", "b"] and m.refs("c") == 0
    m.acquire("a")
    m.release("a")                                     # a still used by one request
    assert m.acquire("c") is None
    m.release("b")
    assert m.acquire("c") == SlotGrant(2, load=True, evicted="b")
    assert m.refs("a") == 1 and m.slot_of("a") == 1


def test_release_and_remove_checks():
    m = LoRASlotManager(1)
    with pytest.raises(ValueError, match="released more often"):
        m.release("a")
    m.acquire("a")
    with pytest.raises(ValueError, match="in use by 1 running"):
        m.remove("a")
    m.release("a")
    assert m.remove("a") == 1 and m.remove("a") is None
    assert m.acquire("b") == SlotGrant(1, load=True)   # the slot came back free
    with pytest.raises(ValueError, match="max_loras"):
        LoRASlotManager(0)


def test_adapter_cache_is_lru_bounded_and_reloads():
    loads = []
    cache = AdapterCache(2, lambda k: loads.append(k) or f"weights:{k}")
    assert cache.get("a") == "weights:a" and cache.get("b") == "weights:b"
    cache.get("a")                        # a most recent
    cache.get("c")                        # drops b
    assert cache.keys() == ["a", "c"] and "b" not in cache
    assert cache.get("b") == "weights:b"  # read again
    assert loads == ["a", "b", "c", "b"]
    cache.discard("b")
    assert cache.keys() == ["c"]


def test_adapter_cache_failed_load_caches_nothing():
    def load(k):
        raise ValueError(f"bad adapter {k}")
    cache = AdapterCache(1, load)
    with pytest.raises(ValueError, match="bad adapter x"):
        cache.get("x")
    assert cache.keys() == []
