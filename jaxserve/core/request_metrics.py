"""RequestMetrics: when things happened to one request (vLLM's RequestMetrics).

Host only, no jax. Every time is read from the monotonic clock and shifted by one
offset taken at import, so a value can be compared with time.time() (seconds since
the epoch) while the difference of two values is a monotonic interval that a step of
the wall clock (NTP, a manual change) cannot bend. Intervals therefore only make
sense between times read in the same process.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

# monotonic() + _EPOCH_OFFSET ~ time.time(), fixed for the life of the process.
_EPOCH_OFFSET = time.time() - time.monotonic()


def now() -> float:
    """The current time on the request clock (seconds since the epoch, monotonic)."""
    return time.monotonic() + _EPOCH_OFFSET


def from_monotonic(t: float) -> float:
    """A time.monotonic() reading of this process, on the request clock."""
    return t + _EPOCH_OFFSET


@dataclass(slots=True)
class RequestMetrics:
    """One request's timeline, filled in by the engine; None: not happened yet.

    For a request with n > 1 completions the times are the group's: scheduled when
    its first completion was, first token when any completion got one, last token
    when any did, finished when the last one finished. num_generation_tokens counts
    the tokens of all its completions.
    """
    arrival_time: float                        # the engine was handed the request
    first_scheduled_time: float | None = None  # a step first computed any of it
    first_token_time: float | None = None      # its first generated token came back
    last_token_time: float | None = None       # its latest generated token came back
    finished_time: float | None = None         # it finished (any reason, abort too)
    num_generation_tokens: int = 0

    @property
    def time_in_queue(self) -> float | None:
        """arrival -> first scheduled."""
        return _span(self.arrival_time, self.first_scheduled_time)

    @property
    def time_to_first_token(self) -> float | None:
        """arrival -> first token."""
        return _span(self.arrival_time, self.first_token_time)

    @property
    def prefill_time(self) -> float | None:
        """first scheduled -> first token."""
        return _span(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        """first token -> last token."""
        return _span(self.first_token_time, self.last_token_time)

    @property
    def inference_time(self) -> float | None:
        """first scheduled -> last token."""
        return _span(self.first_scheduled_time, self.last_token_time)

    @property
    def e2e_latency(self) -> float | None:
        """arrival -> finished."""
        return _span(self.arrival_time, self.finished_time)


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start
