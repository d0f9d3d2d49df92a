"""Narrow float caches held as their bits on CPU (pallas_kernels/held_dtypes.py): the
same values as a cache of floats, and no pass over the whole cache in the engine step."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxserve.runner.layer_caches import make_layer_caches
from models.config import ModelConfig
from models.layer_stack import CONV, KV
from models.registry import build_model
from models.weights import load_params
from pallas_kernels.gated_delta import ragged_causal_conv1d
from pallas_kernels.held_dtypes import as_values, held_dtype, value_dtype
from pallas_kernels.ragged_paged_attention import make_kv_cache, paged_loop, write_kv
from pallas_kernels.ragged_paged_attention.dispatch import ragged_paged_attention
from tests.checkpoints import make_tiny_checkpoint
from tests.models.batch_util import make_inputs

NARROW = [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn]


def _bytes(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("dtype", NARROW)
def test_held_dtypes(dtype):
    held = held_dtype(dtype, "cpu")
    assert held != jnp.dtype(dtype) and jnp.issubdtype(held, jnp.integer)
    assert held.itemsize == jnp.dtype(dtype).itemsize and value_dtype(held) == jnp.dtype(dtype)
    for platform in ("tpu", "gpu", "cuda"):
        assert held_dtype(dtype, platform) == jnp.dtype(dtype)
    # int8 is the int8 KV cache, float32 needs no help; e5m2 has no integer type left
    for other in (jnp.int8, jnp.float32, jnp.float8_e5m2):
        assert held_dtype(other, "cpu") == jnp.dtype(other) == value_dtype(other)


@pytest.mark.parametrize("dtype", NARROW)
def test_kv_cache_held_as_bits(dtype):
    """Writing into a cache held as bits stores exactly the bits a cache of the values
    would hold, and every reader sees the same values."""
    held = held_dtype(dtype, "cpu")
    rng = np.random.default_rng(1)
    num_pages, S, K, H = 5, 16, 2, 8
    slots = np.array([17, 18, 40, 3], np.int32)
    k = jnp.asarray(rng.standard_normal((4, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((4, K, H)), jnp.float32)
    scale = None if dtype != jnp.float8_e4m3fn else jnp.full((K, 2), 0.5, jnp.float32)
    as_floats = write_kv(make_kv_cache(num_pages, S, K, H, dtype), k, v, slots, scale)
    as_bits = jax.jit(write_kv)(make_kv_cache(num_pages, S, K, H, held), k, v, slots, scale)
    assert as_bits.dtype == held
    np.testing.assert_array_equal(_bytes(as_values(as_bits)), _bytes(as_floats))
    q = jnp.asarray(rng.standard_normal((3, 2 * K, H)), jnp.float32)
    meta = dict(kv_lens=jnp.array([3, 25], jnp.int32),
                page_table=jnp.array([[1, 0], [1, 2]], jnp.int32),
                query_start_loc=jnp.array([0, 1, 3], jnp.int32),
                num_seqs=jnp.array([2], jnp.int32), sm_scale=0.3, kv_scale=scale)
    for impl in ("reference", "xla"):
        want = ragged_paged_attention(q, as_floats, impl=impl, **meta)
        got = ragged_paged_attention(q, as_bits, impl=impl, **meta)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("native", [True, False])
def test_cpu_attention_dots_are_bf16_only_where_the_cpu_has_them(monkeypatch, native):
    """A bf16 cache's K / V go into bf16 dots where the CPU multiplies bf16 natively, into
    float32 ones where XLA would emulate them (slower there)."""
    monkeypatch.setattr(paged_loop, "cpu_has_bf16_dot", lambda: native)
    cache = make_kv_cache(4, 16, 2, 8, held_dtype(jnp.bfloat16, "cpu"))
    args = (jnp.zeros((2, 4, 8), jnp.float32), cache, jnp.array([3, 5], jnp.int32),
            jnp.array([[0], [1]], jnp.int32), jnp.array([0, 1, 2], jnp.int32),
            jnp.array([2], jnp.int32))
    jaxpr = jax.make_jaxpr(lambda *a: paged_loop.ragged_paged_attention(
        *a, sm_scale=0.3))(*args).jaxpr
    kinds = [str(v.aval.dtype) for eqn in _equations(jaxpr)
             if eqn.primitive.name == "dot_general" for v in eqn.invars]
    assert len(kinds) == 4 and set(kinds) == {"bfloat16" if native else "float32"}, kinds


def _equations(jaxpr):
    """Every equation of jaxpr, those of the loops' and conditions' bodies included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_conv_state_held_as_bits():
    """The DeltaNet's conv state held as bits: same outputs, same stored values."""
    rng = np.random.default_rng(2)
    taps, channels, slots_n = 4, 8, 6
    x = jnp.asarray(rng.standard_normal((5, channels)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((taps, channels)), jnp.bfloat16)
    state = jnp.asarray(rng.standard_normal((slots_n, channels * (taps - 1))), jnp.bfloat16)
    args = (jnp.array([2, 4], jnp.int32), jnp.array([0, 3, 5], jnp.int32),
            jnp.array([2], jnp.int32), jnp.array([True, False]))
    y_f, state_f = ragged_causal_conv1d(x, w, state, *args)
    bits = jax.lax.bitcast_convert_type(state, held_dtype(jnp.bfloat16, "cpu"))
    y_b, state_b = jax.jit(ragged_causal_conv1d)(x, w, bits, *args)
    assert state_b.dtype == bits.dtype
    np.testing.assert_array_equal(_bytes(y_b), _bytes(y_f))
    np.testing.assert_array_equal(_bytes(as_values(state_b)), _bytes(state_f))


def _cache_sized_ops(hlo: str, size: int) -> list[tuple[str, str]]:
    """(element type, op) of every instruction whose result has `size` elements."""
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]\S* (\S+?)\(", line)
        if m and m.group(2) and np.prod([int(d) for d in m.group(2).split(",")]) == size:
            found.append((m.group(1), m.group(3)))
    return found


# What touching a donated cache in place compiles to; a convert or a copy is a pass over it.
# (dynamic-update-slice: the write as XLA:CPU's legacy emitters keep it, the suite's
# SPEED_FLAGS in tests/conftest.py; in place on a donated buffer, as the scatter is.)
_IN_PLACE = {"scatter", "fusion", "parameter", "bitcast", "get-tuple-element", "tuple",
             "dynamic-update-slice"}


@pytest.mark.parametrize("family,dtype", [("llama", jnp.bfloat16), ("llama", jnp.float16),
                                          ("qwen3_5", jnp.bfloat16)])
def test_narrow_float_step_never_passes_over_a_cache(tmp_path, family, dtype):
    """The donated step of a 16-bit model on CPU, with its caches as the runner
    allocates them, touches its KV cache (and a hybrid's conv state) only through the
    in-place update: no op yields a float array of a cache's size (XLA:CPU converted
    the whole cache to float32 and back around every write before they were held as
    bits), and its temporaries stay below one layer's cache."""
    path = make_tiny_checkpoint(family, tmp_path)
    cfg = ModelConfig.from_pretrained(path)
    model = build_model(cfg, dtype, attention_backend="xla", scan_layers=False)
    params = load_params(path, cfg, model, dtype)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    hybrid = family == "qwen3_5"
    caches, _ = make_layer_caches(cfg, mesh, num_pages=2048, page_size=16, kv_dtype=dtype,
                                  num_state_slots=1024 if hybrid else 0,
                                  conv_state_dtype=dtype)
    inputs, _ = make_inputs([(np.arange(3, 23), 0, [5, 9])], num_tokens=32, num_rows=4,
                            state_slots=[3] if hybrid else None)
    step = jax.jit(lambda p, c, i: model.apply({"params": p}, c, i), donate_argnums=(1,))
    compiled = step.lower(params, caches, inputs).compile()
    hlo = compiled.as_text()
    for kind in (KV, CONV) if hybrid else (KV,):
        assert caches[kind].dtype == held_dtype(dtype, "cpu")
        ops = _cache_sized_ops(hlo, caches[kind].size)
        assert ops and {op for _, op in ops} <= _IN_PLACE, (kind, ops[:6])
        assert not any(t.startswith(("f", "bf")) for t, _ in ops), (kind, ops[:6])
    per_layer = min(caches[KV].nbytes // cfg.num_layers, caches.get(CONV, caches[KV]).nbytes)
    assert compiled.memory_analysis().temp_size_in_bytes < per_layer
