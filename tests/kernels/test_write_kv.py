"""write_kv: the cache layout and in-place updates under the donated, jitted model step."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.layer_stack import KV, cache_shapes
from models.registry import build_model
from models.weights import load_params
from pallas_kernels.ragged_paged_attention import make_kv_cache, write_kv
from tests.checkpoints import make_tiny_checkpoint
from tests.models.batch_util import make_inputs


def test_write_kv_places_rows_and_drops_bad_slots():
    rng = np.random.default_rng(0)
    num_pages, S, K, H = 6, 16, 2, 8
    cache = jnp.asarray(rng.standard_normal(make_kv_cache(num_pages, S, K, H, jnp.float32).shape),
                        jnp.float32)
    slots = np.array([3 * S + 5, 1 * S + 0, 5 * S + 15, -1, num_pages * S + 2], np.int32)
    k = rng.standard_normal((len(slots), K, H)).astype(np.float32)
    v = rng.standard_normal((len(slots), K, H)).astype(np.float32)
    got = np.asarray(jax.jit(write_kv)(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots)))
    want = np.asarray(cache).copy()
    heads = want.reshape(num_pages, K, 2, S, H)    # a view: entry 2k + kv of axis 1
    for i, s in enumerate(slots[:3]):
        heads[s // S, :, 0, s % S] = k[i]
        heads[s // S, :, 1, s % S] = v[i]
    np.testing.assert_array_equal(got, want)     # slots -1 and past the end change nothing


def test_write_kv_rejects_mismatched_shapes():
    cache = make_kv_cache(4, 16, 2, 8, jnp.float32)
    with pytest.raises(ValueError, match="expected"):
        write_kv(cache, jnp.zeros((3, 2, 4)), jnp.zeros((3, 2, 4)), jnp.zeros(3, jnp.int32))


@pytest.mark.parametrize("scan_layers", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_donated_model_step_updates_caches_in_place(tmp_path, backend, scan_layers):
    """The compiled step aliases the stacked KV cache to its output and never copies
    it, nor a layer's slice of it: the only cache-sized buffer is the donated argument."""
    path = make_tiny_checkpoint("llama", tmp_path)
    cfg = ModelConfig.from_pretrained(path)
    model = build_model(cfg, jnp.float32, attention_backend=backend, scan_layers=scan_layers)
    params = load_params(path, cfg, model, jnp.float32)
    num_pages = 1024        # make the cache the largest buffer by far
    shapes = cache_shapes(cfg, num_pages=num_pages, page_size=16, kv_dtype=jnp.float32,
                          num_state_slots=0, conv_state_dtype=jnp.float32)
    caches = {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}
    inputs, _ = make_inputs([(np.arange(3, 23), 0, [5, 9])], num_tokens=32, num_rows=4)
    step = jax.jit(lambda p, c, i: model.apply({"params": p}, c, i), donate_argnums=(1,))
    compiled = step.lower(params, caches, inputs).compile()
    hlo = compiled.as_text()

    header = hlo.splitlines()[0]
    aliases = re.findall(r"\{(\d+)\}: \((\d+), \{\}, may-alias\)", header)
    assert aliases, header[:400]
    layer_shape = (num_pages, *caches[KV].shape[1:])
    for shape in (caches[KV].shape, layer_shape):
        text = "f32[{}]".format(",".join(map(str, shape)))
        copies = [ln for ln in hlo.splitlines() if text in ln and re.search(r"= \S+ copy\(", ln)]
        assert not copies, copies[:3]
    stats = compiled.memory_analysis()
    assert stats.temp_size_in_bytes < caches[KV].nbytes // cfg.num_layers, stats


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
def test_narrow_float_cache_held_as_bits_on_cpu(dtype):
    """On CPU a narrow float cache is held as the bits of its values (cache.py says
    why): writing into it stores exactly the bits a cache of the values would hold,
    and both readers see the same values."""
    from pallas_kernels.ragged_paged_attention.cache import (as_values, kv_storage_dtype,
                                                             value_dtype)
    from pallas_kernels.ragged_paged_attention.dispatch import ragged_paged_attention
    held = kv_storage_dtype(dtype, "cpu")
    assert held != jnp.dtype(dtype) and jnp.issubdtype(held, jnp.integer)
    assert value_dtype(held) == jnp.dtype(dtype)
    assert kv_storage_dtype(dtype, "tpu") == jnp.dtype(dtype)
    rng = np.random.default_rng(1)
    num_pages, S, K, H = 5, 16, 2, 8
    slots = np.array([17, 18, 40, 3], np.int32)
    k = jnp.asarray(rng.standard_normal((4, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((4, K, H)), jnp.float32)
    scale = None if dtype != jnp.float8_e4m3fn else jnp.full((K, 2), 0.5, jnp.float32)
    as_floats = write_kv(make_kv_cache(num_pages, S, K, H, dtype), k, v, slots, scale)
    as_bits = jax.jit(write_kv)(make_kv_cache(num_pages, S, K, H, held), k, v, slots, scale)
    assert as_bits.dtype == held
    np.testing.assert_array_equal(np.asarray(as_values(as_bits)).view(np.uint8),
                                  np.asarray(as_floats).view(np.uint8))
    q = jnp.asarray(rng.standard_normal((3, 2 * K, H)), jnp.float32)
    meta = dict(kv_lens=jnp.array([3, 25], jnp.int32),
                page_table=jnp.array([[1, 0], [1, 2]], jnp.int32),
                query_start_loc=jnp.array([0, 1, 3], jnp.int32),
                num_seqs=jnp.array([2], jnp.int32), sm_scale=0.3, kv_scale=scale)
    for impl in ("reference", "xla"):
        want = ragged_paged_attention(q, as_floats, impl=impl, **meta)
        got = ragged_paged_attention(q, as_bits, impl=impl, **meta)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_float_engine_step_never_passes_over_the_cache(tmp_path, dtype):
    """The donated step of a 16-bit model on CPU, with its caches as the runner
    allocates them, touches the KV cache only through the in-place update: no op
    (a convert to float32 and back, a copy) yields a whole-cache-sized array, and its
    temporaries stay far below one layer's cache. Before the cache was held as bits,
    XLA:CPU converted the whole cache to float32 and back around every write."""
    from jax.sharding import Mesh
    from jaxserve.runner.layer_caches import make_layer_caches
    path = make_tiny_checkpoint("llama", tmp_path)
    cfg = ModelConfig.from_pretrained(path)
    model = build_model(cfg, dtype, attention_backend="xla", scan_layers=False)
    params = load_params(path, cfg, model, dtype)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    num_pages = 2048        # make the cache the largest buffer by far
    caches, _ = make_layer_caches(cfg, mesh, num_pages=num_pages, page_size=16,
                                  kv_dtype=dtype, num_state_slots=0, conv_state_dtype=dtype)
    inputs, _ = make_inputs([(np.arange(3, 23), 0, [5, 9])], num_tokens=32, num_rows=4)
    step = jax.jit(lambda p, c, i: model.apply({"params": p}, c, i), donate_argnums=(1,))
    compiled = step.lower(params, caches, inputs).compile()
    whole = caches[KV].size
    cache_sized = []
    for line in compiled.as_text().splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]\S* (\S+?)\(", line)
        if m and m.group(2) and np.prod([int(d) for d in m.group(2).split(",")]) >= whole:
            cache_sized.append((m.group(1), m.group(3)))
    # Per layer: the scatter that updates it in place, and the fusion around it.
    held = caches[KV].dtype.name.replace("uint", "u").replace("int", "s")
    assert cache_sized and {t for t, _ in cache_sized} == {held}, cache_sized[:6]
    moves = {"scatter", "fusion", "parameter", "bitcast", "get-tuple-element", "tuple"}
    assert {op for _, op in cache_sized} <= moves, \
        cache_sized[:6]
    stats = compiled.memory_analysis()
    assert stats.temp_size_in_bytes < caches[KV].nbytes // cfg.num_layers, stats
