"""Which LoRA adapter sits in which device slot, and the host's cache of loaded adapters.

Host-only bookkeeping (no jax). The device holds `max_loras` adapter slots, 1..max_loras
(slot 0 is "no adapter": models/lora/slots.py); the scheduler acquires a slot for a
request's adapter before scheduling it and releases it when the request finishes or is
preempted. An adapter that a running request uses is pinned (reference count > 0) and
never evicted; a free slot goes first, then the least recently used unpinned adapter's.
When every slot is pinned by other adapters, acquire returns None: the request waits.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True)
class SlotGrant:
    """The slot an adapter got. load: its weights must be written there before the step
    that uses it (it was not resident); evicted: the adapter whose slot it took."""
    slot: int
    load: bool
    evicted: Hashable | None = None


class LoRASlotManager:
    """LRU over `max_loras` device slots with reference counts."""

    def __init__(self, max_loras: int):
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.max_loras = max_loras
        # Resident adapters, least recently used first: adapter id -> slot.
        self._resident: OrderedDict[Hashable, int] = OrderedDict()
        self._refs: dict[Hashable, int] = {}
        self._free = list(range(max_loras, 0, -1))   # pop() hands out slot 1 first

    def acquire(self, adapter: Hashable) -> SlotGrant | None:
        """A slot for `adapter`, pinned until release(adapter); None when every slot is
        pinned by other adapters (nothing changes then)."""
        if adapter in self._resident:
            self._resident.move_to_end(adapter)
            self._refs[adapter] += 1
            return SlotGrant(self._resident[adapter], load=False)
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = next((a for a in self._resident if self._refs[a] == 0), None)
            if evicted is None:
                return None
            slot = self._resident.pop(evicted)
            del self._refs[evicted]
        self._resident[adapter] = slot
        self._refs[adapter] = 1
        return SlotGrant(slot, load=True, evicted=evicted)

    def release(self, adapter: Hashable) -> None:
        """One user of `adapter` is done (it stays resident, now evictable at zero)."""
        if self._refs.get(adapter, 0) < 1:
            raise ValueError(f"LoRA adapter {adapter!r} released more often than acquired")
        self._refs[adapter] -= 1

    def remove(self, adapter: Hashable) -> int | None:
        """Unloads `adapter` from its slot (its slot, to clear; None if not resident).
        Refused while a running request uses it."""
        if adapter not in self._resident:
            return None
        if self._refs[adapter]:
            raise ValueError(f"LoRA adapter {adapter!r} is in use by {self._refs[adapter]} "
                             f"running request(s)")
        slot = self._resident.pop(adapter)
        del self._refs[adapter]
        self._free.append(slot)
        return slot

    def slot_of(self, adapter: Hashable) -> int | None:
        return self._resident.get(adapter)

    def refs(self, adapter: Hashable) -> int:
        return self._refs.get(adapter, 0)

    @property
    def resident(self) -> list[Hashable]:
        """Resident adapters, least recently used first."""
        return list(self._resident)


class AdapterCache(Generic[K, V]):
    """Loaded adapters on the host, at most `capacity` (--max-cpu-loras), least recently
    used dropped first; a dropped adapter is read again by `load` when next needed."""

    def __init__(self, capacity: int, load: Callable[[K], V]):
        if capacity < 1:
            raise ValueError(f"max_cpu_loras must be at least 1, got {capacity}")
        self.capacity = capacity
        self._load = load
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = self._load(key)   # a failed load caches nothing
        self._items[key] = value
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return value

    def discard(self, key: K) -> None:
        self._items.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def keys(self) -> list[K]:
        """Cached keys, least recently used first."""
        return list(self._items)


class SchedulerLoRA:
    """The scheduler's side of LoRA (a mixin of core/scheduler.Scheduler): a request
    holds its adapter's slot (Request.lora_slot) from when it is scheduled out of the
    waiting queue until it finishes or is preempted."""

    lora: LoRASlotManager | None

    def _take_lora_slot(self, req, loads: list) -> bool:
        """A slot for a waiting request's adapter (kept on the request; an adapter that
        was not resident joins `loads` as (slot, adapter)). False: every slot is pinned
        by running requests' other adapters, so the request waits."""
        if req.lora_request is None:
            return True
        if self.lora is None:
            raise ValueError(f"request {req.request_id!r} names LoRA adapter "
                             f"{req.lora_request.lora_name!r}, but the scheduler has no "
                             f"LoRA slots (LoRA is off)")
        grant = self.lora.acquire(req.lora_request.lora_int_id)
        if grant is None:
            return False
        if grant.load:
            loads.append((grant.slot, req.lora_request))
        req.lora_slot = grant.slot
        return True

    def _drop_lora_slot(self, req) -> None:
        """The request stops running: its adapter's slot may be evicted once unused."""
        if req.lora_slot:
            self.lora.release(req.lora_request.lora_int_id)
            req.lora_slot = 0

    def remove_lora(self, lora_int_id: int) -> None:
        """Unloads an adapter (its slot freed). ValueError while a request, running or
        waiting, uses it."""
        users = [r for r in self.requests.values() if r.lora_id == lora_int_id]
        if users:
            raise ValueError(f"LoRA adapter {users[0].lora_request.lora_name!r} is in use by "
                             f"{len(users)} unfinished request(s)")
        if self.lora is not None:
            self.lora.remove(lora_int_id)
