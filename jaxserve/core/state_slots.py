"""Recurrent-state slots: the fixed per-sequence state of a hybrid model's linear-attention
layers lives in slots 1..n-1 of every such layer's state array; slot 0 is the null slot
that padding rows read and write. Each running request holds one slot."""
from __future__ import annotations


class StateSlotPool:
    def __init__(self, num_slots: int) -> None:
        """num_slots: as the cache plan counts them, the null slot included."""
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is the null slot), got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))   # pop() gives slot 1 first

    def allocate(self) -> int | None:
        """A free slot, or None when every slot is taken."""
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def free_slots(self) -> list[int]:
        return self._free[:]

    @property
    def num_free(self) -> int:
        return len(self._free)
