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

