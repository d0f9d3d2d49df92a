"""The scales of a quantized KV cache: one for K and one for V per full-attention layer
and KV head (the model's "kv_scales" param [A, K, 2], models/llama.py).

Why per head and static: the kernels then never see a scale -- q * k_scale and
out * v_scale fold them outside (pallas_kernels/ragged_paged_attention) -- and a head's
range is a property of its weights, steadier across tokens than across heads.

fp8 (e4m3, e5m2): scale 1 by default, as vLLM's. A float format keeps its relative
precision over a wide range (e4m3: normal from 2^-6 to 448), so typical K and V need no
fitting; but a head whose values are much smaller (|x| < 2^-6) falls into the
subnormals and loses its mantissa bits, and values past the range are clipped (never
NaN). --calculate-kv-scales measures the scales as int8's are (below), with
FP8_MARGIN: an e4m3 head's absmax lands at 448 / FP8_MARGIN = 56, and values down to
2^-11 of it stay normal.

int8: fixed point needs the range, so it is always measured at start-up: a prefill of
CALIBRATION_TOKENS seeded pseudo-random tokens through the model with a float cache, then
scale = MARGIN * absmax / 127 per layer, head and K/V. Deterministic (the same model gets
the same scales on every start); MARGIN leaves room for text whose K or V exceed the
calibration's, at the cost of one bit of resolution (an fp8 margin costs nothing until
the smallest values leave the normal range, so FP8_MARGIN is larger).

Every KV array is calibrated on its own (Gemma 4: the global and the sliding layers).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.inputs import ModelInputs
from models.layer_stack import KV_SCALES, cache_shapes

CALIBRATION_TOKENS = 512
MARGIN = 2.0
FP8_MARGIN = 8.0
_INT8_MAX = 127.0
_PAGE = 16


def calculates_scales(kv_dtype: Any, calculate: bool) -> bool:
    """Whether a quantized cache of kv_dtype gets measured scales: int8 always, fp8
    with --calculate-kv-scales."""
    return jnp.dtype(kv_dtype) == jnp.int8 or calculate


def kv_scales(model: Any, params: dict, kv_dtype: Any, *, calculate: bool = False,
              seed: int = 0) -> dict[str, jax.Array]:
    """The scale params ("kv_scales" [A, K, 2], and Gemma 4's "kv_scales_sliding") for a
    cache of kv_dtype (see the module docstring); calculate: measure fp8's too. Runs
    under the caller's mesh (jax.set_mesh) when the params are sharded."""
    names = [name for name, _ in KV_SCALES.values() if name in params]
    if not calculates_scales(kv_dtype, calculate):
        return {name: jnp.ones(params[name].shape, jnp.float32) for name in names}
    dtype = jnp.dtype(kv_dtype)
    top = _INT8_MAX / MARGIN if dtype == jnp.int8 else float(jnp.finfo(dtype).max) / FP8_MARGIN
    return {name: jax.device_put(np.where(a > 0, a / top, 1.0).astype(np.float32),
                                 params[name].sharding)
            for name, a in calibration_absmax(model, params, seed=seed).items()}


def calibration_inputs(cfg: Any, conv_state_dtype: Any, *, seed: int = 0,
                       num_tokens: int = CALIBRATION_TOKENS
                       ) -> tuple[dict[str, jax.Array], ModelInputs]:
    """Caches of every layer (KV in float32, room for num_tokens, a multiple of the
    page) and one prefill of num_tokens seeded pseudo-random tokens into them."""
    n, pages = num_tokens, num_tokens // _PAGE
    caches = {kind: jnp.zeros(s.shape, s.dtype) for kind, s in cache_shapes(
        cfg, num_pages=pages + 1, page_size=_PAGE, kv_dtype=jnp.float32, num_state_slots=2,
        conv_state_dtype=conv_state_dtype).items()}
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, n)
    positions = np.arange(n)
    page_ids = np.arange(1, pages + 1)
    inputs = ModelInputs(
        token_ids=jnp.asarray(tokens, jnp.int32), positions=jnp.asarray(positions, jnp.int32),
        slot_mapping=jnp.asarray(page_ids[positions // _PAGE] * _PAGE + positions % _PAGE, jnp.int32),
        query_start_loc=jnp.asarray([0, n], jnp.int32), seq_lens=jnp.asarray([n], jnp.int32),
        page_table=jnp.asarray(page_ids[None], jnp.int32), num_seqs=jnp.asarray([1], jnp.int32),
        state_slots=jnp.asarray([1], jnp.int32) if cfg.is_hybrid else None)
    return caches, inputs


def head_absmax(cache: jax.Array, pages_per_layer: int) -> jax.Array:
    """Largest |K| and |V| [A, K, 2] of each layer and KV head of a stacked KV cache
    [A * pages_per_layer, 2K, S, H] (make_kv_cache's layout: K and V of head k at 2k, 2k+1)."""
    n, two_k, s, h = cache.shape
    kv = cache.reshape(n // pages_per_layer, pages_per_layer, two_k // 2, 2, s, h)
    return jnp.max(jnp.abs(kv.astype(jnp.float32)), axis=(1, 4, 5))


def calibration_absmax(model: Any, params: dict, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Scale param name -> largest |K| and |V| [A, K, 2] each layer and KV head of its
    KV array writes in a prefill of CALIBRATION_TOKENS tokens, with the cache in float32."""
    cfg = model.config
    plain = model.clone(config=replace(cfg, kv_cache_quantized=False))
    scale_names = {kind: name for kind, (name, _) in KV_SCALES.items() if name in params}
    plain_params = {k: v for k, v in params.items() if k not in scale_names.values()}
    caches, inputs = calibration_inputs(cfg, plain.dtype, seed=seed)
    pages = CALIBRATION_TOKENS // _PAGE + 1

    def absmax(p, c, x):
        _, c = plain.apply({"params": p}, c, x)
        return {name: head_absmax(c[kind], pages) for kind, name in scale_names.items()}

    return {name: np.asarray(a) for name, a in
            jax.jit(absmax)(plain_params, caches, inputs).items()}
