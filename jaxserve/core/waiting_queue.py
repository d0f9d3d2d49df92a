"""The priority policy's waiting queue (fcfs uses a deque)."""
from __future__ import annotations

import heapq
from collections.abc import Iterator

from jaxserve.core.request import Request


class PriorityQueue:
    """Waiting requests ordered by (priority, arrival_time); ties keep insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = 0

    def push(self, req: Request) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (req.priority, req.arrival_time, self._seq, req))

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not req]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """The waiting requests, in no particular order."""
        return (e[3] for e in self._heap)

    def __len__(self) -> int:
        return len(self._heap)
