"""Restore from the host tier, or recompute? The scheduler's cost model (docs/TIERED_CACHE.md).

A prefix found in host memory can be copied back into free device pages or computed
again by prefill. Restoring n tokens costs a fixed latency (a copy program's dispatch
and the link's round trip) plus n * bytes_per_token over the measured host->device
bandwidth, plus a hybrid's state snapshot (state_bytes, once); recomputing costs a
prefill: n * prefill_s_per_token, plus attention's quadratic term (every token attends
to the ones before it: n^2 / 2 pairs). So short prefixes are cheaper to recompute, long
ones to restore; a tie recomputes (no copy to wait on, no host pages pinned).

A restore also takes room in the step it is scheduled in: `budget_tokens` says how many
prefill tokens of the step's token budget it counts as (its time in prefill tokens,
at least one so a step cannot schedule unbounded restores).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestoreCost:
    bytes_per_token: float           # every KV array's bytes of one token, all layers
    bandwidth_bytes_per_s: float     # measured host -> device
    prefill_s_per_token: float       # a prefill's linear cost per token
    attention_s_per_pair: float = 0.0  # its quadratic cost per (query, key) pair
    latency_s: float = 0.0           # fixed cost of one restore
    state_bytes: float = 0.0         # copied with any restore: a hybrid's snapshot, a sliding window

    def __post_init__(self) -> None:
        for name in ("bytes_per_token", "bandwidth_bytes_per_s", "prefill_s_per_token"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("attention_s_per_pair", "latency_s", "state_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def restore_s(self, num_tokens: int) -> float:
        _check_tokens(num_tokens)
        if num_tokens == 0:
            return 0.0
        copied = num_tokens * self.bytes_per_token + self.state_bytes
        return self.latency_s + copied / self.bandwidth_bytes_per_s

    def recompute_s(self, num_tokens: int) -> float:
        _check_tokens(num_tokens)
        return (num_tokens * self.prefill_s_per_token
                + num_tokens * num_tokens / 2 * self.attention_s_per_pair)

    def worth_restoring(self, num_tokens: int) -> bool:
        """Whether restoring num_tokens from host beats recomputing them (strictly)."""
        _check_tokens(num_tokens)
        return num_tokens > 0 and self.restore_s(num_tokens) < self.recompute_s(num_tokens)

    def budget_tokens(self, num_tokens: int) -> int:
        """Prefill tokens of a step's budget that restoring num_tokens counts as."""
        if num_tokens == 0:
            return 0
        return max(1, math.ceil(self.restore_s(num_tokens) / self.prefill_s_per_token))

    def break_even_tokens(self, max_tokens: int) -> int | None:
        """The fewest tokens (<= max_tokens) worth restoring, or None. Recomputing
        minus restoring is convex in n and <= 0 at n = 0, so once positive it stays
        positive: restores pay from here on."""
        lo, hi = 1, max_tokens
        if max_tokens < 1 or not self.worth_restoring(max_tokens):
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if self.worth_restoring(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo


def _check_tokens(num_tokens: int) -> None:
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
