"""runner/transfer_timer.py: each watched transfer filed once, in the bucket of its time,
on a thread that starts with the first watch and stops at close; a failed transfer is not
timed (the step that scatters it fails on its own)."""
from __future__ import annotations

import time

import jax.numpy as jnp
import pytest

from jaxserve.core.host_cache import RESTORE_TIME_BUCKETS
from jaxserve.runner.transfer_timer import TransferTimer


class Broken:
    """A pytree leaf whose readiness wait raises, as a failed transfer's would."""

    def block_until_ready(self):
        raise RuntimeError("transfer failed")


def test_each_transfer_is_filed_once_by_its_time():
    timer = TransferTimer()
    assert timer.wait_idle() and timer.counts() == ((0,) * (len(RESTORE_TIME_BUCKETS) + 1), 0.0)
    now = time.perf_counter()
    timer.watch(now, {"kv": jnp.ones(4)})
    timer.watch(now - 5.0, [jnp.zeros(2)])            # started 5 s ago: past the last bound
    assert timer.wait_idle()
    buckets, total = timer.counts()
    assert sum(buckets) == 2 and buckets[-1] == 1     # +Inf holds the 5 s one
    assert total >= 5.0
    timer.close()
    timer.watch(time.perf_counter(), jnp.ones(1))     # a later watch starts a new thread
    assert timer.wait_idle() and sum(timer.counts()[0]) == 3
    timer.close()


def test_a_failed_transfer_is_not_timed():
    timer = TransferTimer()
    timer.watch(time.perf_counter(), Broken())
    timer.watch(time.perf_counter(), jnp.ones(1))
    assert timer.wait_idle()
    assert sum(timer.counts()[0]) == 1
    timer.close()


@pytest.mark.parametrize("seconds", [0.0, RESTORE_TIME_BUCKETS[3], 1e9])
def test_bucket_bounds_are_upper_bounds(seconds):
    timer = TransferTimer()
    timer._file(seconds)
    buckets, _ = timer.counts()
    want = next((i for i, b in enumerate(RESTORE_TIME_BUCKETS) if seconds <= b),
                len(RESTORE_TIME_BUCKETS))
    assert buckets[want] == 1 and sum(buckets) == 1
