"""Recurrent-state snapshots of hybrid models, for prefix caching.

A Gated DeltaNet layer's state after position p sums up every token before p, so a
prefix hit on a hybrid model needs two things: the KV pages up to p (attention layers)
and the recurrent state at p (linear-attention layers). A snapshot is a copy of one
request's state at a page boundary p, kept in a slot of the state arrays past the
running requests' slots, and keyed by the chained hash of the page that ends at p (the
KV pages' own key). A hit is then "the cached pages up to p + the snapshot at p": it
needs the pages too, so a snapshot whose pages were evicted is never used, and ages out.

Snapshots are taken on device after a step's forward (jaxserve/runner: the state of a
row at the end of its chunk) and restored before one (into the request's own slot), so
a snapshot taken in a step becomes usable only once that step has run (`commit`).

Two kinds:
- a request's rolling snapshot: one slot per running request, overwritten at each page
  boundary its chunks end on (the end of its prompt's last full page, then every page
  of its output), so when it finishes, or is preempted, the slot holds its state at its
  last page boundary and stays cached: the next turn of a chat, which extends this
  conversation, restarts from there;
- a branch snapshot: a request whose prompt shares cached pages past the last snapshot
  (a shared system prompt that another request computed) stops a prefill chunk at the
  end of the shared pages and keeps the state there for good, so every later request
  with that prefix skips it.

Which snapshot to give up when the slots run out: the one whose expected saving is
least -- the tokens it lets a hit skip, times one plus the hits it has had (a prefix
that was shared is likely to be shared again; one never hit is a guess), decayed by how
long ago it was last used (half of its value per HALF_LIFE hits and takes). Every
snapshot costs the same bytes, so this is saving per byte: Marconi's trade-off between
recency and the FLOPs a state saves, in a simpler rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

HALF_LIFE = 64   # hits and takes after which an unused snapshot's value halves


@dataclass(slots=True)
class Snapshot:
    slot: int
    page_hash: int | None   # None: not (yet) valid for any prefix
    num_tokens: int          # the position it is the state at
    last_used: int           # the clock at its last take or hit
    owner: str | None = None  # the request whose rolling snapshot it is
    num_hits: int = 0         # hits since it was taken


@dataclass(frozen=True, slots=True)
class PendingSave:
    """A copy the next step makes after its forward: `src_slot` (a request's) into
    `snapshot.slot`, valid for `page_hash` once the step has run."""
    src_slot: int
    snapshot: Snapshot
    page_hash: int
    num_tokens: int


class SnapshotCache:
    """Slots [first_slot, first_slot + num_slots) of the recurrent-state arrays."""

    def __init__(self, first_slot: int, num_slots: int) -> None:
        if first_slot < 1 or num_slots < 0:
            raise ValueError(f"bad snapshot slots: first {first_slot}, count {num_slots}")
        self.first_slot = first_slot
        self.num_slots = num_slots
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._by_hash: dict[int, Snapshot] = {}     # committed, usable snapshots
        self._rolling: dict[str, Snapshot] = {}     # request id -> its rolling snapshot
        self._pending: list[PendingSave] = []
        self._clock = 0
        self.num_restored_tokens = 0   # tokens hits skipped thanks to a snapshot
        # told of each committed snapshot eviction gives up, before its slot is reused
        # (the host tier keeps it: core/host_hits.py)
        self.on_evict: Callable[[Snapshot], None] | None = None

    # ---- look-ups ----------------------------------------------------------------
    def lookup(self, page_hash: int, num_tokens: int) -> Snapshot | None:
        """The committed snapshot at the end of the page `page_hash` (which ends at
        num_tokens), or None."""
        s = self._by_hash.get(page_hash)
        if s is None or s.num_tokens != num_tokens:
            return None
        return s

    def get(self, page_hash: int) -> Snapshot | None:
        """The committed snapshot at the end of the page `page_hash`, or None."""
        return self._by_hash.get(page_hash)

    def use(self, snapshot: Snapshot) -> None:
        """A hit restores `snapshot` in the coming step."""
        self._clock += 1
        snapshot.last_used = self._clock
        snapshot.num_hits += 1
        self.num_restored_tokens += snapshot.num_tokens

    def has(self, page_hash: int) -> bool:
        """Whether a snapshot for this page exists or is being taken."""
        return page_hash in self._by_hash or any(p.page_hash == page_hash
                                                  for p in self._pending)

    # ---- takes -------------------------------------------------------------------
    def save_rolling(self, request_id: str, src_slot: int, page_hash: int,
                     num_tokens: int) -> bool:
        """The request's state at num_tokens (the end of page `page_hash`) goes to its
        rolling snapshot after the coming step. False: no slot to spare."""
        s = self._rolling.get(request_id)
        if s is None:
            s = self._new_snapshot()
            if s is None:
                return False
            s.owner = request_id
            self._rolling[request_id] = s
        self._pending.append(PendingSave(src_slot, s, page_hash, num_tokens))
        return True

    def save_branch(self, src_slot: int, page_hash: int, num_tokens: int) -> bool:
        """A snapshot kept for good (until evicted) of the state at num_tokens."""
        if self.has(page_hash):
            return False
        s = self._new_snapshot()
        if s is None:
            return False
        self._pending.append(PendingSave(src_slot, s, page_hash, num_tokens))
        return True

    def pending_copies(self) -> list[tuple[int, int]]:
        """The coming step's (src slot, snapshot slot) copies, in order."""
        return [(p.src_slot, p.snapshot.slot) for p in self._pending]

    def commit(self) -> None:
        """The step ran: its snapshots hold the states they were taken for."""
        for p in self._pending:
            s = p.snapshot
            if s.page_hash is not None and self._by_hash.get(s.page_hash) is s:
                del self._by_hash[s.page_hash]   # a rolling snapshot moves on
            old = self._by_hash.get(p.page_hash)
            if old is not None and old is not s:   # (two rows took the same page)
                self._drop(old)
            s.page_hash, s.num_tokens, s.num_hits = p.page_hash, p.num_tokens, 0
            self._by_hash[p.page_hash] = s
        self._pending.clear()

    def discard_pending(self) -> None:
        """The step failed: its copies cannot be trusted. The snapshots they were to
        overwrite are lost too (a copy may have run), so they are dropped."""
        for p in self._pending:
            self._drop(p.snapshot)
        self._pending.clear()

    def release(self, request_id: str) -> None:
        """The request left the running batch (finished, aborted, preempted): its
        rolling snapshot stays as a cached one (its pending save still commits)."""
        s = self._rolling.pop(request_id, None)
        if s is not None:
            s.owner = None
            if s.page_hash is None and not any(p.snapshot is s for p in self._pending):
                self._free_slot(s)

    def reset(self) -> None:
        """Forget every committed snapshot (reset_prefix_cache); rolling ones restart."""
        for s in list(self._by_hash.values()):
            if s.owner is None:
                self._drop(s)
            else:
                del self._by_hash[s.page_hash]
                s.page_hash = None

    # ---- slots -------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _new_snapshot(self) -> Snapshot | None:
        self._clock += 1
        if not self._free and not self._evict():
            return None
        return Snapshot(self._free.pop(), None, 0, self._clock)

    def _evict(self) -> bool:
        """Gives up the committed snapshot of least expected saving that no running
        request owns and no pending copy writes. One a hit of the coming step restores
        may go: the step restores before its forward and saves after it. False: none."""
        busy = {p.snapshot.slot for p in self._pending}
        victims = [s for s in self._by_hash.values() if s.owner is None and s.slot not in busy]
        if not victims:
            return False
        clock = self._clock
        victim = min(victims, key=lambda s: s.num_tokens * (1 + s.num_hits)
                     * 0.5 ** ((clock - s.last_used) / HALF_LIFE))
        if self.on_evict is not None:
            self.on_evict(victim)
        self._drop(victim)
        return True

    def _drop(self, s: Snapshot) -> None:
        if s.page_hash is not None and self._by_hash.get(s.page_hash) is s:
            del self._by_hash[s.page_hash]
        s.page_hash = None
        if s.owner is not None:
            del self._rolling[s.owner]
            s.owner = None
        self._free_slot(s)

    def _free_slot(self, s: Snapshot) -> None:
        self._free.append(s.slot)
