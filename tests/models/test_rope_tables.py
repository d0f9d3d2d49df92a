"""RoPE's cos and sin tables (models/layers.rope_tables): on XLA:CPU computed once into
buffers that every layer's rotations read, where XLA would otherwise fuse them into every
consumer and evaluate each again per head and per half of the rotation; the same values."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import apply_rope, rope_inv_freq, rope_tables

T, N, K, H, LAYERS = 256, 8, 2, 64, 3
INV_FREQ = rope_inv_freq(H, 500000.0, None)


def _layers(q, k, positions, tables_fn):
    """LAYERS layers' rotations of q and k, each layer's tables from tables_fn."""
    out = []
    for _ in range(LAYERS):
        tables = tables_fn(positions, INV_FREQ)
        q = apply_rope(q, tables) * 1.01
        k = apply_rope(k, tables) * 1.01
        out.append(q.sum() + k.sum())
    return q, k, jnp.stack(out)


def plain_tables(positions, inv_freq):
    """rope_tables as every platform but CPU computes them (fused where XLA likes)."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]


def _args():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((T, N, H)), jnp.float32),
            jnp.asarray(rng.standard_normal((T, K, H)), jnp.float32),
            jnp.asarray(rng.integers(0, 4096, T), jnp.int32))


def _transcendentals(fn) -> int:
    text = jax.jit(lambda q, k, p: _layers(q, k, p, fn)).lower(*_args()).compile().as_text()
    return sum(line.count(" cosine(") + line.count(" sine(") for line in text.splitlines()
               if "fusion(" not in line)


def test_the_tables_are_the_plain_cos_and_sin():
    got = jax.jit(lambda q, k, p: _layers(q, k, p, rope_tables))(*_args())
    want = jax.jit(lambda q, k, p: _layers(q, k, p, plain_tables))(*_args())
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-5)


def test_on_cpu_each_table_is_computed_once_not_per_consumer():
    # (XLA places a cosine / sine op in each fused computation that evaluates it; the
    # layers' loops are the same computation, which XLA keeps once: one cos, one sin)
    assert _transcendentals(rope_tables) == 2
    assert _transcendentals(plain_tables) > 2 * LAYERS
