"""pallas_kernels/sorted_search.bucket_of: numpy's searchsorted(side="right") answers,
and no while loop in the programs that use it (a GPU launches each of a while loop's
iterations from the host; the H100 profile found two such loops in every layer)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention.blocks import plan_items
from pallas_kernels.sorted_search import bucket_of


@pytest.mark.parametrize("n", [1, 2, 9, 17, 64])
def test_bucket_of_is_searchsorted_right(n):
    rng = np.random.default_rng(n)
    ends = np.sort(rng.integers(0, 40, n)).astype(np.int32)   # repeats: empty requests
    x = np.arange(-2, 45, dtype=np.int32)
    assert np.array_equal(np.asarray(bucket_of(jnp.asarray(ends), jnp.asarray(x))),
                          np.searchsorted(ends, x, side="right"))


def test_the_attention_plan_has_no_while_loop():
    qsl = jnp.array([0, 3, 4, 4, 9], jnp.int32)
    kv = jnp.array([10, 4, 0, 5], jnp.int32)
    fn = jax.jit(lambda q, k, s: plan_items(q, k, s, num_tokens=16, block_q=8, kv_step=16,
                                            page_size=16, sliding_window=None))
    hlo = fn.lower(qsl, kv, jnp.array([4], jnp.int32)).as_text()
    assert "stablehlo.while" not in hlo
    meta, token_item, _, valid = fn(qsl, kv, jnp.array([4], jnp.int32))
    assert np.asarray(valid).sum() == 9
