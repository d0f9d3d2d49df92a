"""The restore-vs-recompute cost model on its boundaries."""
from __future__ import annotations

import pytest

from jaxserve.core.restore_cost import RestoreCost

# 1 KiB per token over 1 GB/s: 1.024 us per token restored; prefill 2 us per token;
# 100 us to start a restore: restores pay from 100 / (2 - 1.024) = 102.5 tokens.
COST = RestoreCost(bytes_per_token=1024, bandwidth_bytes_per_s=1e9, prefill_s_per_token=2e-6,
                   latency_s=100e-6)


def test_short_prefixes_are_recomputed_long_ones_restored():
    assert not COST.worth_restoring(0)
    assert not COST.worth_restoring(1)
    assert not COST.worth_restoring(102)
    assert COST.worth_restoring(103)
    assert COST.worth_restoring(100_000)
    assert COST.break_even_tokens(10_000) == 103
    assert COST.break_even_tokens(102) is None


def test_a_tie_recomputes():
    tie = RestoreCost(bytes_per_token=1000, bandwidth_bytes_per_s=1e9, prefill_s_per_token=1e-6)
    assert tie.restore_s(64) == pytest.approx(tie.recompute_s(64))
    assert not tie.worth_restoring(64)


def test_a_slow_link_never_pays_without_attention_and_always_does_with_it():
    slow = RestoreCost(bytes_per_token=1024, bandwidth_bytes_per_s=1e8, prefill_s_per_token=2e-6)
    assert slow.break_even_tokens(1 << 20) is None
    # Attention's quadratic term makes long prefixes expensive to recompute whatever
    # the link: 10.24 us/token restored vs 2 us + n * 1 ns / 2 recomputed: n > 16480.
    quad = RestoreCost(bytes_per_token=1024, bandwidth_bytes_per_s=1e8, prefill_s_per_token=2e-6,
                       attention_s_per_pair=1e-9)
    assert quad.break_even_tokens(1 << 20) == 16481
    assert not quad.worth_restoring(16480) and quad.worth_restoring(1 << 20)


def test_a_hybrid_snapshot_is_paid_once():
    hybrid = RestoreCost(bytes_per_token=1024, bandwidth_bytes_per_s=1e9,
                         prefill_s_per_token=2e-6, state_bytes=1e6)
    assert hybrid.restore_s(10) == pytest.approx((10 * 1024 + 1e6) / 1e9)
    assert hybrid.break_even_tokens(10_000) > COST.break_even_tokens(10_000) - 100 > 0


def test_budget_tokens():
    assert COST.budget_tokens(0) == 0
    # 1000 tokens: 100 us + 1024 us = 1124 us = 562 prefill tokens.
    assert COST.budget_tokens(1000) == 562
    fast = RestoreCost(bytes_per_token=1, bandwidth_bytes_per_s=1e12, prefill_s_per_token=1e-3)
    assert fast.budget_tokens(1) == 1             # never free


@pytest.mark.parametrize("field", ["bytes_per_token", "bandwidth_bytes_per_s",
                                   "prefill_s_per_token"])
def test_non_positive_rates_are_refused(field):
    args = dict(bytes_per_token=1, bandwidth_bytes_per_s=1, prefill_s_per_token=1)
    args[field] = 0
    with pytest.raises(ValueError, match=field):
        RestoreCost(**args)


def test_negative_tokens_are_refused():
    with pytest.raises(ValueError, match="num_tokens"):
        COST.worth_restoring(-1)
