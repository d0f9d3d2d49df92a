"""The runner's bucket ladders: every size a step can have maps to a bucket that pads
at most a third of it (beyond the smallest; tokens: half below 512, where a step on an
accelerator is bound by the weights' reads, but for a CPU's decode sizes from 48), and the
largest bucket is the cap."""
from __future__ import annotations

import pytest

from jaxserve.runner.buckets import (page_buckets, pick_bucket, power_of_two_at_least, row_buckets,
                                     sampling_row_buckets, token_buckets)


def test_ladders():
    assert token_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert token_buckets(2048) == (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048)
    # On CPU a step is compute-bound from a few dozen tokens: the decode sizes (here up
    # to 100 tokens) get the midpoints from 48.
    assert token_buckets(512, cpu_decode_tokens=100) == (16, 32, 48, 64, 96, 128, 256, 512)
    assert token_buckets(512, cpu_decode_tokens=47) == token_buckets(512)
    assert row_buckets(64) == (8, 12, 16, 24, 32, 48, 64)
    assert row_buckets(100) == (8, 12, 16, 24, 32, 48, 64, 96, 100)
    assert row_buckets(5) == (5,)
    assert sampling_row_buckets(100) == (8, 16, 32, 64, 100)
    assert page_buckets(128) == (4, 8, 16, 32, 64, 128)
    assert page_buckets(130) == (4, 8, 16, 32, 64, 128, 130)


def test_power_of_two_at_least():
    assert [power_of_two_at_least(n) for n in (0, 1, 2, 3, 16, 17)] == [1, 1, 2, 4, 16, 32]
    assert power_of_two_at_least(5, 16) == 16 and power_of_two_at_least(17, 16) == 32


def test_a_size_past_the_ladder_is_refused():
    with pytest.raises(ValueError, match="2049 exceeds the largest bucket 2048"):
        pick_bucket(token_buckets(2048), 2049)


@pytest.mark.parametrize("ladder,pads_half", [
    (token_buckets(8192), lambda b: b <= 512),
    (token_buckets(8192, cpu_decode_tokens=256), lambda b: b <= 32 or 256 < b <= 512),
    (row_buckets(64), lambda b: False), (row_buckets(100), lambda b: False)])
def test_padding_at_most_a_third(ladder, pads_half):
    for n in range(1, ladder[-1] + 1):
        b = pick_bucket(ladder, n)
        assert b >= n
        if n > ladder[0]:
            assert b - n < b / (2 if pads_half(b) else 3) + 1e-9, (n, b)
