"""SchedulerStats: what the scheduler counts, the engine's one statistics record."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

from jaxserve.core.host_cache import HostCacheStats


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """What the scheduler counts; the one statistics record (the engines add to it)."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0   # tokens looked up
    prefix_cache_hits: int = 0      # tokens found
    num_preemptions: int = 0
    # Totals since start (monotonic, for counters): prompt tokens of prefills that
    # completed (a prompt counts once per completion, again if preempted before its
    # first token) and tokens generated.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # Speculative decoding totals (vLLM's spec_decode counters): rows that verified
    # drafts, drafts verified, drafts accepted, and drafts accepted at each position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # The prefix cache's host tier (None: none; core/host_cache.py).
    host: HostCacheStats | None = None
    # LoRA (vLLM's lora_requests_info): device slots (0: LoRA off) and the adapters of
    # the running and the waiting requests, by name.
    max_lora: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries \
            else 0.0

    @staticmethod
    def merge(parts: list[SchedulerStats]) -> SchedulerStats:
        """Several schedulers as one (data-parallel replicas): counts summed, KV usage the
        mean of theirs (every replica has a pool of the same size)."""
        return SchedulerStats(
            num_running=sum(p.num_running for p in parts),
            num_waiting=sum(p.num_waiting for p in parts),
            kv_cache_usage=sum(p.kv_cache_usage for p in parts) / len(parts),
            prefix_cache_queries=sum(p.prefix_cache_queries for p in parts),
            prefix_cache_hits=sum(p.prefix_cache_hits for p in parts),
            num_preemptions=sum(p.num_preemptions for p in parts),
            num_prompt_tokens=sum(p.num_prompt_tokens for p in parts),
            num_generation_tokens=sum(p.num_generation_tokens for p in parts),
            spec_num_drafts=sum(p.spec_num_drafts for p in parts),
            spec_num_draft_tokens=sum(p.spec_num_draft_tokens for p in parts),
            spec_num_accepted_tokens=sum(p.spec_num_accepted_tokens for p in parts),
            spec_accepted_per_pos=tuple(map(sum, zip(*(p.spec_accepted_per_pos
                                                       for p in parts)))),
            host=_merge_host([p.host for p in parts]),
            max_lora=parts[0].max_lora,
            running_lora_adapters=_union(p.running_lora_adapters for p in parts),
            waiting_lora_adapters=_union(p.waiting_lora_adapters for p in parts))


def _merge_host(parts: list[HostCacheStats | None]) -> HostCacheStats | None:
    """Each replica's host tier summed (each has its own)."""
    given = [p for p in parts if p is not None]
    if not given:
        return None
    def total(values: list):   # a histogram's bucket counts add up bucket by bucket
        if isinstance(values[0], tuple):
            return tuple(map(sum, itertools.zip_longest(*values, fillvalue=0)))
        return sum(values)
    return HostCacheStats(**{f.name: total([getattr(p, f.name) for p in given])
                             for f in fields(HostCacheStats)})


def _union(names) -> tuple[str, ...]:
    return tuple(sorted(set().union(*names)))
