"""benchmarks.shared.agreement: exact counts, and a divergence is found where it is."""
from __future__ import annotations

import pytest

from benchmarks.shared.agreement import compare_outputs, summary


def test_identical():
    a = compare_outputs([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]])
    assert a["all_agree"] and a["identical_requests"] == 2 and a["first_mismatch"] is None
    assert a["token_rate"] == 1.0 and a["tokens_compared"] == 5


def test_divergence_counted():
    jax_out = [[1, 2, 3, 4], [7, 8, 9, 9], [5, 5, 5, 5]]
    ref_out = [[1, 2, 3, 4], [7, 8, 0, 9], [6, 5, 5, 5]]
    a = compare_outputs(jax_out, ref_out, first_k=2)
    assert not a["all_agree"] and a["identical_requests"] == 1
    assert a["first_k_agree"] == 2                     # request 1 diverges at token 2
    assert a["tokens_before_divergence"] == 4 + 2 + 0 and a["tokens_compared"] == 12
    m = a["first_mismatch"]
    assert (m["request"], m["position"], m["jaxserve"], m["reference"]) == (1, 2, 9, 0)
    assert "1/3 requests identical" in summary(a)


def test_lengths_compare_the_common_part_and_must_pair():
    assert compare_outputs([[1, 2, 3]], [[1, 2]])["all_agree"]
    with pytest.raises(ValueError, match="outputs"):
        compare_outputs([[1]], [])
