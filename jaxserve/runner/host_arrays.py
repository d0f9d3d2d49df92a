"""The host tier's memory: per cache kind, the layers a host slot holds and the numpy pools
(the copies between them and the device caches: runner/host_tier.py).

HostPageArrays: numpy pools, one per cache kind: [slots, A, *row] for a KV array (a host
page slot holds one page id's rows in all A layers; a sliding-window KV array has slots
of its own, fewer: a cached prefix needs only its last window's), [state slots, D, *row] for the conv
and recurrent state (one snapshot's rows in all D linear-attention layers). A model
drafter's KV (DRAFT_KV: its own array on the target's page ids) travels with the target's
KV: same page ids, same host slots, a pool of its own. Entries
keep the cache's dtype as held (bf16 as uint16 bits on CPU, fp8 / int8 as stored); a
quantized cache's scales (per layer and head, not per page) are kept once, and a
restore under other scales is refused. Under jax.distributed each process keeps its own
devices' part of every row (runner/host_local.py), in the slots the leader picks for all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from jaxserve.core import host_pages
from jaxserve.core.host_pages import size_host_tier, size_sliding_host_tier
from jaxserve.runner.host_local import local_box, to_local
from models.layer_stack import CONV, KV, KV_SLIDING, RECURRENT

DRAFT_KV = "draft_kv"   # a model drafter's KV array (runner/drafter.py), paged as KV
PAGE_KINDS = (KV, KV_SLIDING, DRAFT_KV)
STATE_KINDS = (CONV, RECURRENT)


@dataclass(frozen=True)
class HostTierLayout:
    """Per cache kind: the layers stacked in it and one layer's row (shape, held dtype);
    local_rows: this process's part of a row where the caches span processes (its
    devices' heads), else the whole row."""
    layers: Mapping[str, int]
    rows: Mapping[str, tuple[tuple[int, ...], np.dtype]]
    local_rows: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, caches: Mapping[str, Any], layers: Mapping[str, int]) -> HostTierLayout:
        """From the caches (arrays or ShapeDtypeStructs) and each kind's layer count
        (models/layer_stack.num_owners)."""
        kinds = [k for k in (*PAGE_KINDS, *STATE_KINDS) if k in caches]
        local = {}
        for k in kinds:
            shape, sharding = caches[k].shape, getattr(caches[k], "sharding", None)
            if sharding is None or sharding.is_fully_addressable:
                continue
            box = local_box(sharding, shape)
            if (box[0].start, box[0].stop) != (0, shape[0]):
                raise ValueError(f"{k}: a cache whose pages are split over processes "
                                 f"({sharding}): the host tier keeps whole pages")
            local[k] = tuple(b.stop - b.start for b in box[1:])
        return cls({k: layers[k] for k in kinds},
                   {k: (tuple(caches[k].shape[1:]), np.dtype(caches[k].dtype)) for k in kinds},
                   local)

    def local_row(self, kind: str) -> tuple[int, ...]:
        return self.local_rows.get(kind, self.rows[kind][0])

    def _bytes(self, kinds: Sequence[str]) -> int:
        return sum(self.layers[k] * math.prod(self.rows[k][0]) * self.rows[k][1].itemsize
                   for k in kinds if k in self.rows)

    @property
    def page_bytes(self) -> int:
        """Bytes of one host page slot (the global KV array's rows of one page id, and the
        drafter's)."""
        return self._bytes((KV, DRAFT_KV))

    @property
    def sliding_page_bytes(self) -> int:
        """Bytes of one host sliding page slot (0: no sliding-window KV array)."""
        return self._bytes((KV_SLIDING,))

    @property
    def state_bytes(self) -> int:
        """Bytes of one host state slot (0: not a hybrid model)."""
        return self._bytes(STATE_KINDS)


class HostPageArrays:
    def __init__(self, layout: HostTierLayout, num_slots: int, num_state_slots: int = 0,
                 kv_scales: Mapping[str, Any] | None = None,
                 num_sliding_slots: int | None = None) -> None:
        """num_sliding_slots: the sliding KV array's (None: num_slots)."""
        self.layout = layout
        self.arrays = {}
        count = {KV: num_slots, DRAFT_KV: num_slots,
                 KV_SLIDING: num_slots if num_sliding_slots is None else num_sliding_slots}
        for kind, (_, dtype) in layout.rows.items():
            n = count.get(kind, num_state_slots)
            self.arrays[kind] = np.zeros((n, layout.layers[kind], *layout.local_row(kind)),
                                         dtype)
        self.adopt_scales(kv_scales)

    @classmethod
    def for_budget(cls, layout: HostTierLayout, budget_bytes: int,
                   kv_scales: Mapping[str, Any] | None = None,
                   sliding_per_page: float | None = None) -> HostPageArrays:
        """As many slots as budget_bytes hold (core/host_pages.size_host_tier; with a
        sliding KV array, sliding_per_page sliding slots per page slot, None:
        core/host_pages.sliding_per_page); refused, naming
        the sizes, when that is not one page (and one snapshot, one sliding page) beside
        the dummy."""
        if layout.sliding_page_bytes:
            per = sliding_per_page or host_pages.sliding_per_page(layout.page_bytes,
                                                                  layout.sliding_page_bytes)
            slots, states, sliding = size_sliding_host_tier(
                budget_bytes, layout.page_bytes, layout.sliding_page_bytes, per,
                layout.state_bytes)
        else:
            (slots, states), sliding = size_host_tier(budget_bytes, layout.page_bytes,
                                                      layout.state_bytes), None
        if not slots:
            raise ValueError(f"a host tier of {budget_bytes} bytes holds no page of "
                             f"{layout.page_bytes} bytes (and snapshot of "
                             f"{layout.state_bytes}, sliding page of "
                             f"{layout.sliding_page_bytes}) beside the dummy slot")
        return cls(layout, slots, states, kv_scales, sliding)

    @property
    def num_slots(self) -> int:
        return self.arrays[KV].shape[0]

    @property
    def num_sliding_slots(self) -> int:
        return self.arrays[KV_SLIDING].shape[0] if KV_SLIDING in self.arrays else 0

    @property
    def num_state_slots(self) -> int:
        return next((a.shape[0] for k, a in self.arrays.items() if k in STATE_KINDS), 0)

    def adopt_scales(self, kv_scales: Mapping[str, Any] | None) -> None:
        """The KV scales the pages stored from now on are under (the arrays' contents
        mean nothing under them: the prefix cache was reset)."""
        self._scales_seen = dict(kv_scales or {})   # held: their ids cannot be reused
        self.kv_scales = {k: _local(v) for k, v in self._scales_seen.items()}

    def same_scales(self, kv_scales: Mapping[str, Any] | None) -> bool:
        """Whether kv_scales are those the pages were stored under: the same arrays (the
        per-step check: no copy), else equal values (then remembered as the same)."""
        given = dict(kv_scales or {})
        if given.keys() == self._scales_seen.keys() and all(
                given[k] is self._scales_seen[k] for k in given):
            return True
        if given.keys() != self.kv_scales.keys() or any(
                not np.array_equal(_local(given[k]), self.kv_scales[k]) for k in given):
            return False
        self._scales_seen = given
        return True

    def check_scales(self, kv_scales: Mapping[str, Any] | None) -> None:
        """Pages stored under some scales mean other values under others."""
        if not self.same_scales(kv_scales):
            raise ValueError("the host tier's pages were stored under other KV scales: "
                             "reset it (reset_prefix_cache) before restoring")


def _local(x: Any) -> np.ndarray:
    """A scale array's process-local block (scales are split by head as the cache is)."""
    return to_local(x) if isinstance(x, jax.Array) else np.asarray(x)
