"""A step while the scheduler fills it (core/scheduler.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.core.sched_output import NewRequestData


@dataclass(eq=False)
class StepDraft:
    """A step while the scheduler fills it: the token budget left, the running rows it
    took (as columns), the new rows, the preempted ids and the drafts to verify."""
    budget: int
    ids: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    pages: list[tuple[list[int], ...]] = field(default_factory=list)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    spec: dict[str, list[int]] = field(default_factory=dict)
    restore_tokens: int = 0   # the budget host-tier restores took
    lora_loads: list[tuple[int, object]] = field(default_factory=list)   # (slot, adapter)
