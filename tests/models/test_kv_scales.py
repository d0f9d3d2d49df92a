"""Measured KV scales (models/kv_scales.py; --calculate-kv-scales for fp8, always for int8).

A head whose keys are small falls into e4m3's subnormals at scale 1 and loses most of its
precision; with measured scales it keeps fp8's. Measured as the relative error of the K
and V a quantized model writes (and reads back: later layers see the quantized cache)
against the float model's, on tokens other than the calibration's. Every KV array is
calibrated on its own (Gemma 4: global and sliding layers)."""
from __future__ import annotations

import glob
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from models.config import ModelConfig
from models.kv_scales import calibration_inputs, kv_scales
from models.layer_stack import KV_SCALES
from models.llama import KV_LAYER_TYPE
from models.registry import build_model
from models.weights import load_params
from pallas_kernels.ragged_paged_attention.quant import dequantize, quantize
from tests.checkpoints import make_tiny_checkpoint

E4M3 = "float8_e4m3fn"
SMALL_KEYS = 0.01   # k_proj scaled by this: |K| up to ~7e-3, below e4m3's normals (2^-6)


def _load(path: str):
    mc = ModelConfig.from_pretrained(path)
    model = build_model(replace(mc, kv_cache_quantized=True), "float32", "reference")
    return mc, model, load_params(path, mc, model, "float32")


def _by_head(cache: jax.Array, layers: int) -> jax.Array:
    """[A * pages, 2K, S, H] -> [A, pages, K, 2, S, H] (K and V of a head side by side)."""
    n, two_k, s, h = cache.shape
    return cache.reshape(layers, n // layers, two_k // 2, 2, s, h)


def _rel_error(got: jax.Array, want: jax.Array) -> tuple[float, float]:
    """Relative error of K and of V ([..., 2, S, H] layout of _by_head)."""
    return tuple(float(jnp.linalg.norm(got[..., j, :, :] - want[..., j, :, :])
                       / jnp.linalg.norm(want[..., j, :, :])) for j in range(2))


def _float_caches(mc, model, params):
    """The float model's caches after a prefill of 128 tokens the calibration never saw."""
    caches, inputs = calibration_inputs(mc, jnp.float32, seed=7, num_tokens=128)
    plain = {k: v for k, v in params.items() if not k.startswith("kv_scales")}
    _, out = jax.jit(model.clone(config=mc).apply)({"params": plain}, caches, inputs)
    return caches, inputs, out


@pytest.fixture(scope="module")
def small_keys(tmp_path_factory):
    """(config, quantized-cache model, params) of a tiny llama whose keys are small."""
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("small_keys"))
    (file,) = glob.glob(f"{path}/*.safetensors")
    tensors = load_file(file)
    for name in tensors:
        if name.endswith("k_proj.weight"):
            tensors[name] = tensors[name] * SMALL_KEYS
    save_file(tensors, file, metadata={"format": "pt"})
    return _load(path)


def test_small_keys_lose_precision_at_scale_one_and_keep_it_measured(small_keys):
    mc, model, params = small_keys
    caches, inputs, want = _float_caches(mc, model, params)
    want = _by_head(want["kv"], mc.num_layers)
    assert float(jnp.abs(want[..., 0, :, :]).max()) < 2.0 ** -6   # keys in the subnormals
    errors = {}
    for calculate in (False, True):
        scales = kv_scales(model, params, E4M3, calculate=calculate)
        fp8 = {k: v.astype(E4M3) if k == "kv" else v for k, v in caches.items()}
        _, got = jax.jit(model.apply)({"params": {**params, **scales}}, fp8, inputs)
        s = scales["kv_scales"][:, None, :, :, None, None]
        errors[calculate] = _rel_error(dequantize(_by_head(got["kv"], mc.num_layers), s), want)
    (k_one, v_one), (k_measured, v_measured) = errors[False], errors[True]
    # Seen: K 0.34 at scale 1, 0.03 measured; V (not small) 0.03 either way. e4m3 rounds
    # to 3 mantissa bits: about 2-3% relative error is its floor.
    assert k_one > 0.2 and k_measured < 0.06, errors
    assert k_one > 5 * k_measured, errors
    assert v_one < 0.06 and v_measured < 0.06, errors


def test_scale_one_stays_without_the_flag_and_int8_is_always_measured(small_keys):
    mc, model, params = small_keys
    assert (np.asarray(kv_scales(model, params, E4M3)["kv_scales"]) == 1).all()
    int8 = np.asarray(kv_scales(model, params, "int8")["kv_scales"])   # measured unasked
    assert int8.shape == (mc.num_layers, mc.num_kv_heads, 2)
    assert (int8[..., 0] < int8[..., 1]).all()   # the small keys get the small scales


def test_every_kv_array_is_calibrated_on_its_own(tmp_path):
    """Gemma 4: the global and the sliding layers' KV each get scales per layer, head and
    K/V that hold their values (quantized then dequantized: no clipping, fp8's or int8's
    rounding only). Measured on the float cache, so the error is each write's own (a
    random tiny Gemma's sharp attention compounds errors across layers)."""
    mc, model, params = _load(make_tiny_checkpoint("gemma4_moe", tmp_path / "g"))
    _, _, want = _float_caches(mc, model, params)
    for kv_dtype, floor in ((E4M3, 0.04), ("int8", 0.03)):   # seen: 0.027, 0.020 at most
        _assert_calibrated(mc, kv_scales(model, params, kv_dtype, calculate=True), want,
                           kv_dtype, floor)


def _assert_calibrated(mc, scales, want, kv_dtype, floor) -> None:
    assert set(scales) == {"kv_scales", "kv_scales_sliding"}
    for kind, (name, _) in KV_SCALES.items():
        s = np.asarray(scales[name])
        layers = len(mc.kv_layers(KV_LAYER_TYPE[kind]))
        assert s.shape[0] == layers and (s > 0).all() and len(np.unique(s)) == s.size
        ref = _by_head(want[kind], layers)
        s6 = jnp.asarray(s)[:, None, :, :, None, None]
        k_err, v_err = _rel_error(dequantize(quantize(ref, s6, kv_dtype), s6), ref)
        assert k_err < floor and v_err < floor, (kind, k_err, v_err)

