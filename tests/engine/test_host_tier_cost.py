"""The host tier's restore-or-recompute model as the engine builds it (build/host_tier.py):
from the restore call, the prefill and attention's pairs timed at warmup, or nominal
without them."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve.build.host_tier import NOMINAL, describe_cost, restore_cost

PS, PPC, PAGE_BYTES = 16, 4, 1 << 20
PLAN = SimpleNamespace(page_size=PS, sliding_pages_per_seq=0, max_model_len=4096)
MC = SimpleNamespace(full_attention_layers=(0, 1), num_heads=4, head_dim=8)
PARAMS = {"w": np.zeros((10, 100), np.float32)}


def tier(call_s: float) -> SimpleNamespace:
    return SimpleNamespace(restore_call_s=call_s, copier=SimpleNamespace(pages_per_call=PPC),
                           layout=SimpleNamespace(page_bytes=PAGE_BYTES, state_bytes=4096,
                                                  sliding_page_bytes=0))


def test_measured_a_restore_costs_a_call_and_a_call_more_per_call_of_pages():
    cost = restore_cost(tier(2e-3), PLAN, PARAMS, MC, "cpu", prefill_s_per_token=1e-4)
    assert cost.latency_s == 2e-3 and cost.prefill_s_per_token == 1e-4
    assert cost.state_bytes == 0   # a state rides in the first call
    assert cost.restore_s(PPC * PS) == pytest.approx(2 * 2e-3)
    assert cost.restore_s(3 * PPC * PS) == pytest.approx(4 * 2e-3)
    # 2 ms + n * 31.25 us (a call per 64 tokens) against n * 100 us (attention's pairs
    # add well under a token's worth): from 2 / (0.1 - 0.03125) = 29.1 tokens on
    assert cost.break_even_tokens(4096) == 30
    line = describe_cost(tier(2e-3), cost, PLAN)
    assert "measured" in line and "2.00 ms" in line
    assert "host hits under 30 tokens are recomputed" in line
    assert "(nominal)" in line   # attention's pairs: not timed
    # attention timed: its pairs' cost is the runner's, and the line says so
    slow = restore_cost(tier(2e-3), PLAN, PARAMS, MC, "cpu", prefill_s_per_token=1e-4,
                        attention_s_per_pair=1e-6)
    assert slow.attention_s_per_pair == 1e-6
    assert slow.break_even_tokens(4096) < cost.break_even_tokens(4096)
    line = describe_cost(tier(2e-3), slow, PLAN, attention_measured=True)
    assert "attention 1000.000 ns per pair of tokens (measured)" in line


def test_nominal_without_timings():
    bandwidth, latency, flops = NOMINAL["cpu"]
    cost = restore_cost(tier(0.0), PLAN, PARAMS, MC, "cpu")
    assert (cost.bandwidth_bytes_per_s, cost.latency_s) == (bandwidth, latency)
    assert cost.prefill_s_per_token == 2 * 1000 / flops
    assert cost.attention_s_per_pair == 4 * 2 * 4 * 8 / flops
    assert cost.state_bytes == 4096
    assert "nominal" in describe_cost(tier(0.0), cost, PLAN)
    fast = restore_cost(tier(1e-6), PLAN, PARAMS, MC, "cpu", prefill_s_per_token=1e-3)
    assert "every host hit is restored" in describe_cost(tier(1e-6), fast, PLAN)


def test_a_model_drafters_share_of_the_parameters_adds_to_a_prefill():
    """A recompute runs the drafter's catch-up too (its KV comes back with the pages: the
    tier's page bytes count it): measured or nominal, a prefill costs its share more."""
    drafter = {"w": np.zeros((10, 30), np.float32)}   # 30 % of the target's parameters
    for kw in (dict(prefill_s_per_token=1e-4), {}):
        alone = restore_cost(tier(2e-3), PLAN, PARAMS, MC, "cpu", **kw)
        drafting = restore_cost(tier(2e-3), PLAN, PARAMS, MC, "cpu", **kw,
                                drafter_params=drafter)
        assert drafting.prefill_s_per_token == pytest.approx(1.3 * alone.prefill_s_per_token)
        if kw:   # (nominal: this model's prefill is too cheap for any restore)
            assert drafting.break_even_tokens(4096) < alone.break_even_tokens(4096)
