"""Async scheduling (--async-scheduling, vLLM's name): the engine schedules and dispatches
step N+1 before it reads step N's sampled tokens back, so the host's work between two
device steps (reading the tokens, the scheduler's update, output processing, the next
schedule and input build) overlaps the device's work instead of following it.

A row whose input token step N is still sampling takes it on the device, from step N's
sampled ids (InputBatch's in_flight, the forward's token_src); the scheduler counts each
request's tokens in flight (Request.num_in_flight) and never schedules past a length
limit they reach. A request that a token of step N stops has computed one step more,
whose token is dropped: its KV lands in its own pages past its tokens (never registered
as full), a hybrid's state in its slot, whose next owner's first chunk starts from zeros
(or a restore) in a later program.

What needs the host to know step N's tokens before step N+1 is built runs in order
instead: for the whole engine (sync_reason_for_engine), or for every step while a request
that needs it is unfinished (sync_reason_for_request). Each reason is logged once.
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("jaxserve")


def sync_reason_for_engine(*, multi_host: bool, speculative: bool, host_tier: bool,
                           state_snapshots: bool) -> str | None:
    """Why this engine cannot overlap its steps at all, or None."""
    if multi_host:
        return "a multi-host engine (its followers run each step as published)"
    if speculative:
        return "speculative decoding (drafts are proposed from the tokens read back)"
    if host_tier:
        return "the host KV tier (its copies land when a step is read back)"
    if state_snapshots:   # (a snapshot is keyed by its page's hash: the tokens first)
        return "a hybrid model's prefix caching (its state snapshots)"
    return None


def sync_reason_for_request(params: Any, multi_modal: Any) -> str | None:
    """Why steps must run in order while this request is unfinished, or None."""
    if params.grammar is not None:
        return "structured outputs (the grammar's next mask needs the last token)"
    bad = params.bad_words_automaton
    if bad is not None and bad.has_sequences:
        return "multi-token bad_words (the next mask needs the last token)"
    if params.has_penalties:
        return "penalties (their token history)"
    if multi_modal is not None:
        return "images"
    return None


class SyncRequests:
    """The unfinished requests that make steps run in order, and the reasons logged."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._logged: set[str] = set()

    def add(self, request_ids: list[str], reason: str | None) -> None:
        if reason is None:
            return
        self._ids.update(request_ids)
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("async scheduling: steps run in order while a request with %s is "
                        "unfinished", reason)

    def any_unfinished(self, unfinished: Any) -> bool:
        """Whether one of them is still in `unfinished` (a container of request ids)."""
        if self._ids:
            self._ids = {r for r in self._ids if r in unfinished}
        return bool(self._ids)
