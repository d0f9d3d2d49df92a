"""The scales of a quantized KV cache: one for K and one for V per full-attention layer
and KV head (the model's "kv_scales" param [A, K, 2], models/llama.py).

Why per head and static: the kernels then never see a scale -- q * k_scale and
out * v_scale fold them outside (pallas_kernels/ragged_paged_attention) -- and a head's
range is a property of its weights, steadier across tokens than across heads.

fp8 (e4m3, e5m2): scale 1, as vLLM's default. A float format keeps its relative
precision at any magnitude inside its range (e4m3: +-448, far above K and V of real
models), so there is nothing to fit; values past the range are clipped, never NaN.

int8: fixed point needs the range, so it is measured once at start-up: a prefill of
CALIBRATION_TOKENS seeded pseudo-random tokens through the model with a float cache, then
scale = MARGIN * absmax / 127 per layer, head and K/V. Deterministic (the same model gets
the same scales on every start); MARGIN leaves room for text whose K or V exceed the
calibration's, at the cost of one bit of resolution.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.inputs import ModelInputs
from models.layer_stack import KV, KV_SCALES, cache_shapes

CALIBRATION_TOKENS = 512
MARGIN = 2.0
_INT8_MAX = 127.0
_PAGE = 16


def kv_scales(model: Any, params: dict, kv_dtype: Any, *, seed: int = 0) -> dict[str, jax.Array]:
    """The scale params ("kv_scales" [A, K, 2], and Gemma 4's "kv_scales_sliding") for a
    cache of kv_dtype (see the module docstring). Runs under the caller's mesh
    (jax.set_mesh) when the params are sharded."""
    names = [name for name, _ in KV_SCALES.values() if name in params]
    if jnp.dtype(kv_dtype) != jnp.int8:
        return {name: jnp.ones(params[name].shape, jnp.float32) for name in names}
    if names != ["kv_scales"]:
        raise ValueError("int8 KV scales are calibrated for one KV array only")
    absmax = calibration_absmax(model, params, seed=seed)
    scale = np.where(absmax > 0, MARGIN * absmax / _INT8_MAX, 1.0).astype(np.float32)
    return {"kv_scales": jax.device_put(scale, params["kv_scales"].sharding)}


def calibration_absmax(model: Any, params: dict, *, seed: int = 0) -> np.ndarray:
    """Largest |K| and |V| [A, K, 2] each layer and KV head writes in a prefill of
    CALIBRATION_TOKENS tokens, with the cache in float32."""
    cfg = model.config
    plain = model.clone(config=replace(cfg, kv_cache_quantized=False))
    plain_params = {k: v for k, v in params.items()
                    if k not in [name for name, _ in KV_SCALES.values()]}
    n, pages = CALIBRATION_TOKENS, CALIBRATION_TOKENS // _PAGE
    caches = {kind: jnp.zeros(s.shape, s.dtype) for kind, s in cache_shapes(
        cfg, num_pages=pages + 1, page_size=_PAGE, kv_dtype=jnp.float32, num_state_slots=2,
        conv_state_dtype=plain.dtype).items()}
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, n)
    positions = np.arange(n)
    page_ids = np.arange(1, pages + 1)
    inputs = ModelInputs(
        token_ids=jnp.asarray(tokens, jnp.int32), positions=jnp.asarray(positions, jnp.int32),
        slot_mapping=jnp.asarray(page_ids[positions // _PAGE] * _PAGE + positions % _PAGE, jnp.int32),
        query_start_loc=jnp.asarray([0, n], jnp.int32), seq_lens=jnp.asarray([n], jnp.int32),
        page_table=jnp.asarray(page_ids[None], jnp.int32), num_seqs=jnp.asarray([1], jnp.int32),
        state_slots=jnp.asarray([1], jnp.int32) if cfg.is_hybrid else None)

    def absmax(p, c, x):
        _, c = plain.apply({"params": p}, c, x)
        kv = c[KV]                                            # [A * (pages+1), 2K, S, H]
        layers = len(cfg.full_attention_layers)
        kv = kv.reshape(layers, pages + 1, cfg.num_kv_heads, 2, _PAGE, cfg.head_dim)
        return jnp.max(jnp.abs(kv), axis=(1, 4, 5))           # [A, K, 2]

    return np.asarray(jax.jit(absmax)(plain_params, caches, inputs))
