"""A request's page lists per KV group (the KV cache manager's record of it), the
prefix cache's counts, and how many pages a sliding window spans."""
from __future__ import annotations

from dataclasses import dataclass

from jaxserve.core.page_pool import KVCachePage

GLOBAL, SLIDING = 0, 1   # KV group indices (core/kv_cache_manager.py)


def window_pages(window: int, page_size: int) -> int:
    """Most pages `window` consecutive positions can span: the window - 1 keys before a
    query take at most ceil((window - 1) / page_size) pages, the query's own one more."""
    return -(-(window - 1) // page_size) + 1


class ReqPages:
    """A request's pages per KV group, their ids (kept in step to copy cheaply), how many
    of its leading pages have been offered to the prefix cache and, in a sliding group,
    how many leading entries are the null page."""

    __slots__ = ("pages", "ids", "num_cached", "state_slot", "num_dropped", "backup_slot")

    def __init__(self, num_groups: int, state_slot: int = 0, backup_slot: int = 0) -> None:
        self.pages: list[list[KVCachePage]] = [[] for _ in range(num_groups)]
        self.ids: list[list[int]] = [[] for _ in range(num_groups)]
        self.num_cached = 0
        self.state_slot = state_slot
        self.num_dropped = 0
        self.backup_slot = backup_slot   # speculative decoding: its state before a step


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    queries: int  # tokens looked up
    hits: int  # tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
