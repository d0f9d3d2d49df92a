"""The runner's bucket ladders: every size a step can have maps to a bucket that pads
at most a third of it (beyond the smallest), and the largest bucket is the cap."""
from __future__ import annotations

import pytest

from jaxserve.runner.input_batch import pick_bucket
from jaxserve.runner.model_runner import row_buckets, token_buckets


def test_ladders():
    assert token_buckets(512) == (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    assert row_buckets(64) == (8, 12, 16, 24, 32, 48, 64)
    assert row_buckets(100) == (8, 12, 16, 24, 32, 48, 64, 96, 100)
    assert row_buckets(5) == (5,)


@pytest.mark.parametrize("ladder", [token_buckets(512), row_buckets(64), row_buckets(100)])
def test_padding_at_most_a_third(ladder):
    for n in range(1, ladder[-1] + 1):
        b = pick_bucket(ladder, n)
        assert b >= n
        if n > ladder[0]:
            assert b - n < b / 3 + 1e-9, (n, b)
