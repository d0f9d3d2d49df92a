"""The copies between the host tier's arrays (runner/host_arrays.py) and the device caches
(docs/TIERED_CACHE.md; the bookkeeping is core/host_pages.HostPageIndex).

HostCopier: two jitted programs of fixed shape, compiled once: offload reads
pages_per_call page ids and states_per_call state slots out of the caches (its result
placed in pinned host memory where the device has it, then fetched asynchronously);
restore writes as many into the donated caches in place (models/page_copies.py), from
rows sent ahead into device staging buffers (`send`, then `scatter`: the transfer
overlaps whatever runs between them).
A longer list is split into several calls; a short one is padded with id 0 (the null page
/ slot) and host slot 0 (the dummy), so nothing recompiles.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from jaxserve.core.sched_output import HostCopies
from jaxserve.runner.host_arrays import (DRAFT_KV, PAGE_KINDS, STATE_KINDS, HostPageArrays,
                                         HostTierLayout)
from jaxserve.runner.host_local import from_local, to_local
from jaxserve.runner.transfer_timer import TransferTimer
from models.layer_stack import KV, KV_SCALES, KV_SLIDING
from models.page_copies import gather_pages, scatter_pages

PINNED_HOST = "pinned_host"
TIMING_S = 0.05   # at most this much start-up time (past one call) timing the restore
LOG_LENGTH = 64   # HostTier.log's latest restores
# Page ids or host slots of a copy, per KV kind (a sliding-window array has slots of its own).
PerKind = Mapping[str, Sequence[int]]
# One restore call's device ids per kind (padded) and its rows, sent to the device.
Staged = tuple[dict[str, np.ndarray], dict[str, jax.Array]]


def host_memory_kind(device: jax.Device) -> str | None:
    """Pinned host memory if the device can place arrays there (GPU, TPU, and CPU in
    recent JAX), else None: the default memory, fetched by device_get."""
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except (AttributeError, NotImplementedError):   # pragma: no cover - older runtimes
        return None
    return PINNED_HOST if PINNED_HOST in kinds else None


class PendingOffload:
    """Device->host copies in flight: `land` writes them into the host arrays."""

    def __init__(self) -> None:
        self._parts: list[tuple[dict[str, jax.Array], dict[str, list[int]]]] = []

    def add(self, gathered: dict[str, jax.Array], slots: dict[str, list[int]]) -> None:
        for x in gathered.values():
            x.copy_to_host_async()
        self._parts.append((gathered, slots))

    def is_ready(self) -> bool:
        return all(x.is_ready() for gathered, _ in self._parts for x in gathered.values())

    def land(self, host: HostPageArrays) -> None:
        """Blocks until the copies are done (if they are not), then stores them."""
        for gathered, slots in self._parts:
            for kind, x in gathered.items():
                n = len(slots[kind])
                if n:
                    rows = to_local(x).reshape(-1, *host.arrays[kind].shape[1:])
                    host.arrays[kind][slots[kind]] = rows[:n]
        self._parts.clear()


class HostCopier:
    def __init__(self, layout: HostTierLayout, shardings: Mapping[str, jax.sharding.Sharding],
                 *, pages_per_call: int = 16, states_per_call: int = 2,
                 memory_kind: str | None = None) -> None:
        """shardings: each cache's; memory_kind: where offloaded pages land (None: the
        device's default memory; host_memory_kind(device) for pinned host memory)."""
        if pages_per_call < 1 or states_per_call < 1:
            raise ValueError(f"pages_per_call {pages_per_call} / states_per_call "
                             f"{states_per_call}: must be >= 1")
        self.layout = layout
        self.pages_per_call = pages_per_call
        self.states_per_call = states_per_call
        self._shardings = {k: shardings[k] for k in layout.rows}
        out = {k: s.with_memory_kind(memory_kind) if memory_kind else s
               for k, s in self._shardings.items()}
        layers = dict(layout.layers)
        self.offload_fn = lambda caches, ids: gather_pages(caches, ids, layers)
        self.restore_fn = lambda caches, ids, values: scatter_pages(caches, ids, values, layers)
        self._offload = jax.jit(self.offload_fn, out_shardings=out)
        self._restore = jax.jit(self.restore_fn, donate_argnums=0)

    @classmethod
    def for_caches(cls, caches: Mapping[str, Any], layers: Mapping[str, int],
                   memory_kind: str | None) -> HostCopier:
        """The copier of these caches (arrays or ShapeDtypeStructs with shardings), each
        kind's `layers` stacked in it."""
        layout = HostTierLayout.of(caches, layers)
        return cls(layout, {k: caches[k].sharding for k in layout.rows}, memory_kind=memory_kind)

    def abstract_call(self, replicated: jax.sharding.Sharding
                      ) -> tuple[dict[str, jax.ShapeDtypeStruct], dict[str, jax.ShapeDtypeStruct]]:
        """One call's (ids, values) as ShapeDtypeStructs: the padded ids of each kind
        (`replicated`), the rows of those ids in every layer (placed as the cache)."""
        n = {k: self.pages_per_call if k in PAGE_KINDS else self.states_per_call
             for k in self.layout.rows}
        ids = {k: jax.ShapeDtypeStruct((n[k],), np.int32, sharding=replicated) for k in n}
        values = {k: jax.ShapeDtypeStruct((n[k] * self.layout.layers[k], *row), dtype,
                                          sharding=self._shardings[k])
                  for k, (row, dtype) in self.layout.rows.items()}
        return ids, values

    def programs(self) -> dict[str, Any]:
        """The jitted copy programs, "offload" (caches, ids) and "restore" (caches donated,
        ids, values), as the engine runs them: to lower for another target."""
        return {"offload": self._offload, "restore": self._restore}

    # ---- batching -------------------------------------------------------------------
    def _calls(self, page_ids: PerKind, host_slots: PerKind, state_ids: Sequence[int],
               host_state_slots: Sequence[int]):
        """Per call: (device ids per kind, padded; host slots per kind, unpadded)."""
        for kind, ids in page_ids.items():
            if kind not in PAGE_KINDS or kind not in self.layout.rows:
                raise ValueError(f"page ids for {kind!r}: this model's page kinds are "
                                 f"{[k for k in PAGE_KINDS if k in self.layout.rows]}")
            if len(ids) != len(host_slots.get(kind, ())):
                raise ValueError(f"{kind}: {len(ids)} page ids for "
                                 f"{len(host_slots.get(kind, ()))} host slots")
        if len(state_ids) != len(host_state_slots):
            raise ValueError(f"{len(state_ids)} state ids for {len(host_state_slots)} slots")
        state_kinds = [k for k in STATE_KINDS if k in self.layout.rows]
        if state_ids and not state_kinds:
            raise ValueError("state ids given for a model without recurrent state")
        bp, bs = self.pages_per_call, self.states_per_call
        calls = max([-(-len(ids) // bp) for ids in page_ids.values()]
                    + [-(-len(state_ids) // bs), 0])
        for c in range(calls):
            ids, slots = {}, {}
            for kind in (k for k in PAGE_KINDS if k in self.layout.rows):
                # A kind not named copies its null page to or from the dummy slot.
                named = kind in page_ids
                part = list(page_ids[kind][c * bp:(c + 1) * bp]) if named else []
                ids[kind] = _pad(part, bp)
                slots[kind] = list(host_slots[kind][c * bp:(c + 1) * bp]) if named else []
            for kind in state_kinds:
                part = list(state_ids[c * bs:(c + 1) * bs])
                ids[kind], slots[kind] = _pad(part, bs), list(host_state_slots[c * bs:(c + 1) * bs])
            yield ids, slots

    # ---- the copies -------------------------------------------------------------------
    def offload(self, caches: Mapping[str, jax.Array], page_ids: PerKind, host_slots: PerKind,
                state_ids: Sequence[int] = (),
                host_state_slots: Sequence[int] = ()) -> PendingOffload:
        """Starts copying pages page_ids[kind][i] (of each KV kind given, into host slot
        host_slots[kind][i]; a kind not given is not stored) and state slots
        state_ids[j] into host_state_slots[j]. Issued now, in order with the steps
        around it, so a later step that rewrites those pages waits for these reads."""
        pending = PendingOffload()
        for ids, slots in self._calls(page_ids, host_slots, state_ids, host_state_slots):
            pending.add(self._offload(dict(caches), ids), slots)
        return pending

    def send(self, host: HostPageArrays, host_slots: PerKind, page_ids: PerKind,
             host_state_slots: Sequence[int] = (), state_ids: Sequence[int] = (),
             kv_scales: Mapping[str, Any] | None = None) -> list[Staged]:
        """The first half of a restore: host slot host_slots[kind][i] (for page
        page_ids[kind][i] of each KV kind given; a kind not given is left alone) and host
        state slot j (for state slot state_ids[j]) gathered now and sent to the device
        (asynchronously) in staging buffers, one per call. No cache is read or written:
        a step's forward dispatched after it does not wait for the transfer. The host
        rows are copied out at once, so their slots may change afterwards."""
        host.check_scales(kv_scales)
        staged = []
        for ids, slots in self._calls(page_ids, host_slots, state_ids, host_state_slots):
            values = {}
            for kind in ids:
                pool = host.arrays[kind]
                take = _pad(slots[kind], len(ids[kind]))
                row, _ = self.layout.rows[kind]
                values[kind] = from_local(pool[take].reshape(-1, *pool.shape[2:]),
                                          self._shardings[kind], (len(take) * pool.shape[1], *row))
            staged.append((ids, values))
        return staged

    def scatter(self, caches: Mapping[str, jax.Array], staged: Sequence[Staged]
                ) -> dict[str, jax.Array]:
        """The second half: caches (donated) with the staged rows written into their page
        ids and state slots, in place; every call has the same shapes and kinds."""
        caches = dict(caches)
        for ids, values in staged:
            caches = self._restore(caches, ids, values)
        return caches

    def restore(self, caches: Mapping[str, jax.Array], host: HostPageArrays,
                host_slots: PerKind, page_ids: PerKind,
                host_state_slots: Sequence[int] = (), state_ids: Sequence[int] = (),
                kv_scales: Mapping[str, Any] | None = None) -> dict[str, jax.Array]:
        """send, then scatter at once (the program waits for the transfer)."""
        return self.scatter(caches, self.send(host, host_slots, page_ids, host_state_slots,
                                              state_ids, kv_scales))


def _pad(ids: list[int], n: int) -> np.ndarray:
    return np.asarray(list(ids) + [0] * (n - len(ids)), np.int32)


class HostTier:
    """The runner's host tier: the arrays, the copy programs, and what was copied. The
    scheduler decides every copy (core/host_cache.py); the runner hands each step's to
    `dispatch` before its forward and lands its offloads when it collects the step. A
    restore is split over two steps: its rows are sent in the step that schedules it
    and scattered into the caches at the start of the next dispatch, before anything
    else reads or writes them, so no forward waits for a host->device transfer."""

    def __init__(self, caches: Mapping[str, jax.Array], layers: Mapping[str, int],
                 budget_bytes: int, device: jax.Device,
                 params: Callable[[], Mapping[str, Any]] = dict) -> None:
        """params: the runner's params now, whose KV scales (a quantized cache's) say
        what the pages stored mean."""
        self._params = params
        self.copier = HostCopier.for_caches(caches, layers, host_memory_kind(device))
        self.layout = self.copier.layout
        self.arrays = HostPageArrays.for_budget(self.layout, budget_bytes, self.kv_scales())
        self.page_kinds = [k for k in PAGE_KINDS if k in self.layout.rows]
        self.restore_seconds = 0.0   # host time to send and scatter restores (asynchronous)
        self.restore_call_s = 0.0    # one restore call, timed at warmup (0: not timed)
        self.timer = TransferTimer()   # each send's transfer time, for /metrics
        self._staged: list[Staged] = []   # the last dispatch's sends, scattered by the next
        self._staged_pages: tuple[int, ...] = ()
        self.num_dispatches = 0
        # (dispatch number, "send" / "scatter", the global page ids) of the latest restores
        self.log: deque[tuple[int, str, tuple[int, ...]]] = deque(maxlen=LOG_LENGTH)

    def kv_scales(self) -> dict[str, Any]:
        """The runner's KV scale params now (models/kv_scales.py; none: a float cache)."""
        params = self._params()
        return {name: params[name] for name, _ in KV_SCALES.values() if name in params}

    def follow_scales(self) -> bool:
        """Whether the runner's KV scales changed since the pages were stored (its params
        were replaced): then every entry is stale and the caller resets the prefix cache
        (both tiers); the new scales are the pages' from now on. Between steps only."""
        scales = self.kv_scales()
        if self.arrays.same_scales(scales):
            return False
        self.arrays.adopt_scales(scales)
        return True

    def dispatch(self, caches: dict[str, jax.Array], copies: HostCopies | None
                 ) -> tuple[dict[str, jax.Array], PendingOffload | None]:
        """Every step, before its forward: the previous dispatch's sends scattered (caches
        donated; device-local copies, first: this step's offloads may read those pages),
        then copies' (core/sched_output.HostCopies) offloads issued (their reads go
        before any later write of those pages) and its restores sent (refused under
        other KV scales than their pages') -> (the caches, the offloads to land)."""
        self.num_dispatches += 1
        t0 = time.perf_counter()
        if self._staged:   # (taken first: a failed scatter is not run again)
            staged, pages = self._staged, self._staged_pages
            self._staged, self._staged_pages = [], ()
            caches = self.copier.scatter(caches, staged)
            self.log.append((self.num_dispatches, "scatter", pages))
            self.restore_seconds += time.perf_counter() - t0
        pending = None
        c = copies
        if c is not None and c.num_offloads:
            pages, slots = self._by_kind((c.offload_pages, c.offload_slots),
                                         (c.offload_sliding_pages, c.offload_sliding_slots))
            pending = self.copier.offload(caches, pages, slots, c.offload_state_ids,
                                          c.offload_state_slots)
        if c is not None and c.num_restores:
            t0 = time.perf_counter()
            pages, slots = self._by_kind((c.restore_pages, c.restore_slots),
                                         (c.restore_sliding_pages, c.restore_sliding_slots))
            self._staged = self.copier.send(self.arrays, slots, pages, c.restore_state_slots,
                                            c.restore_state_ids, self.kv_scales())
            self._staged_pages = tuple(c.restore_pages)
            self.timer.watch(t0, [values for _, values in self._staged])
            self.log.append((self.num_dispatches, "send", self._staged_pages))
            self.restore_seconds += time.perf_counter() - t0
        return caches, pending

    def _by_kind(self, glob: tuple[list[int], list[int]], sliding: tuple[list[int], list[int]]
                 ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """(device page ids, host slots) per KV kind: the global array's (the drafter's
        the same), and the sliding array's (its own ids and slots)."""
        parts = {KV: glob, KV_SLIDING: sliding, DRAFT_KV: glob}
        return ({k: parts[k][0] for k in self.page_kinds},
                {k: parts[k][1] for k in self.page_kinds})

    def warmup(self, caches: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Compiles both programs (a copy of the null page / slot to and from the dummy
        slot: what padding does anyway), then times the restore (restore_call_s)."""
        state = [0] if self.arrays.num_state_slots > 0 else []
        null = {k: [0] for k in self.page_kinds}
        self.copier.offload(caches, null, null, state, state).land(self.arrays)
        times: list[float] = []
        # The first call compiles; then the fastest of a few (a whole call's bytes each,
        # padding included, as every call moves), within TIMING_S of start-up time.
        # (Under jax.distributed every process runs the same programs: always 4 calls.)
        while len(times) < 4 and (sum(times[1:]) < TIMING_S or jax.process_count() > 1):
            t0 = time.perf_counter()
            caches = self.copier.restore(caches, self.arrays, null, null, state, state,
                                         self.kv_scales())
            jax.block_until_ready(caches)
            times.append(time.perf_counter() - t0)
        self.restore_call_s = min(times[1:])
        return caches
