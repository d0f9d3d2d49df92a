"""The persistent batch's rows whose next token is in flight (a mixin of
runner/input_batch.InputBatch), for async scheduling: the engine dispatches step N+1
before it reads step N's tokens back.

A row's `in_flight` is its batch index in the last dispatched step when that step samples
its next token, not yet appended. A step computing that token's position takes it on the
device from that step's sampled ids (token_sources -> HostBatch.token_src, the forward's
prev_ids); append_sampled stores it once read back, finding the rows by request id when
rows moved in between (`generation`)."""
from __future__ import annotations

import numpy as np

from jaxserve.runner.step_rows import ScheduledRows


class InFlightRows:
    """Reads the InputBatch's num_rows, num_tokens and row_of."""

    def _init_in_flight(self, max_rows: int) -> None:
        # Batch index, in the last dispatched step, of the token it samples for the row
        # (not yet appended), or -1; moved with the row (InputBatch._row_arrays).
        self.in_flight = np.full(max_rows, -1, np.int32)
        self.any_in_flight = False   # some row's in_flight is set (else all are -1)
        self._dispatch_id = 0   # steps dispatched (mark_in_flight)
        self.generation = 0     # bumped when rows move (remove): a step's rows are stale

    def mark_in_flight(self, step: ScheduledRows, sampled: bool) -> int:
        """A step was dispatched (`sampled`: with its sampler): its sampling rows' next
        tokens are in flight, and no others are (the step before was collected, or its
        tokens are taken on device by this one). -> the step's dispatch id."""
        if self.any_in_flight:
            self.in_flight[:self.num_rows] = -1
        if sampled:
            picked = np.flatnonzero(step.sample)
            self.in_flight[step.rows[picked]] = picked
        self.any_in_flight = sampled
        self._dispatch_id += 1
        return self._dispatch_id

    def rows_now(self, step: ScheduledRows, generation: int) -> np.ndarray:
        """The persistent rows of `step`'s batch rows now (-1: no longer held), for a step
        dispatched at `generation`."""
        if generation == self.generation:
            return step.rows
        row_of = self.row_of
        return np.fromiter((row_of.get(rid, -1) for rid in step.req_ids), np.int32,
                           step.num_reqs)

    def collected(self, dispatch_id: int) -> None:
        """A step's results are read back: when it was the last one dispatched, no token
        is in flight any more (its own are appended next)."""
        if dispatch_id == self._dispatch_id and self.any_in_flight:
            self.in_flight[:self.num_rows] = -1
            self.any_in_flight = False

    def token_sources(self, row_of_token: np.ndarray, positions: np.ndarray,
                      size: int) -> np.ndarray:
        """int32[size]: for each of a step's tokens (row, position) past the row's known
        ones, drafts aside, the in-flight token's index in the last step's sampled ids;
        -1 elsewhere (the host has the token). The step's own array: the forward may read
        it after the host has built the next step (XLA:CPU can take numpy zero-copy)."""
        src = np.full(size, -1, np.int32)
        if self.any_in_flight:
            n = len(positions)
            src[:n] = np.where(positions >= self.num_tokens[row_of_token],
                               self.in_flight[row_of_token], -1)
        return src
