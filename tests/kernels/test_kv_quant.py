"""Quantized KV caches (fp8 e4m3, fp8 e5m2, int8 with per-kv-head scales) on CPU.

quantize / dequantize against numpy (ml_dtypes), write_kv with scales, the scale
checks, and every attention impl -- reference, xla (the page loop), the TPU
kernel body and the GPU kernel body in interpret mode -- on quantized caches:
  - against the float32 reference on the DEQUANTIZED cache: the same math, so a
    float32-sized tolerance (the folded scales only reorder float32 products);
  - against the float64 oracle on the unquantized cache: the quantization error
    itself, checked as a relative RMS per kv head (see _loose_bound).
The batch mixes decodes, a fresh prefill and prefix-cached chunks, with GQA
(G = 3) and K / V scales that differ per head and from each other; the data of
each (head, K or V) is scaled to its own magnitude so every scale matters.
TPU compiles and the cuda lowering: test_kv_quant_compile.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import (KV_QUANT_DTYPES, dequantize, is_quantized,
                                                   kv_cache_dtype_error, make_kv_cache, quantize,
                                                   ragged_paged_attention, tpu, write_kv)
from tests.kernels.rpa_cases import make_batch, oracle, scenarios

DTYPES = [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8]
IDS = ["e4m3", "e5m2", "int8"]
NP_DTYPES = {jnp.dtype(jnp.float8_e4m3fn): ml_dtypes.float8_e4m3fn,
             jnp.dtype(jnp.float8_e5m2): ml_dtypes.float8_e5m2, jnp.dtype(jnp.int8): np.int8}


def _np_quantize(x: np.ndarray, scale, dtype) -> np.ndarray:
    y = x.astype(np.float32) / np.float32(scale)
    if jnp.dtype(dtype) == jnp.int8:
        return np.clip(np.rint(y), -127, 127).astype(np.int8)      # rint: half to even
    top = float(ml_dtypes.finfo(NP_DTYPES[jnp.dtype(dtype)]).max)
    return np.clip(y, -top, top).astype(NP_DTYPES[jnp.dtype(dtype)])


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


# ---- quantize / dequantize ------------------------------------------------------------

def test_names_and_is_quantized():
    assert KV_QUANT_DTYPES["fp8"] == KV_QUANT_DTYPES["fp8_e4m3"] == jnp.float8_e4m3fn
    assert KV_QUANT_DTYPES["fp8_e5m2"] == jnp.float8_e5m2 and KV_QUANT_DTYPES["int8"] == jnp.int8
    assert all(is_quantized(d) for d in DTYPES)
    assert not any(is_quantized(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_quantize_round_trip_matches_numpy(dtype):
    """Bit-exact against ml_dtypes' casts, past the range included (clipped), and
    dequantize = stored * scale exactly."""
    rng = np.random.default_rng(0)
    scale = np.float32(0.037)
    top = 127 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)
    x = (rng.standard_normal(4096) * top * scale / 3).astype(np.float32)
    x[:64] *= 20                                          # well past the range: clipped
    got = quantize(jnp.asarray(x), scale, dtype)
    assert got.dtype == dtype
    want = _np_quantize(x, scale, dtype)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    back = np.asarray(dequantize(got, scale))
    np.testing.assert_array_equal(back, want.astype(np.float32) * scale)
    assert np.abs(back).max() <= top * scale * (1 + 1e-6)
    inside = np.abs(x) < top * scale
    rel = {jnp.dtype(jnp.float8_e4m3fn): 2.0 ** -4, jnp.dtype(jnp.float8_e5m2): 2.0 ** -3}
    if dtype == jnp.int8:
        assert np.abs(back - x)[inside].max() <= scale / 2 * (1 + 1e-6)
    else:          # normal numbers: half an ulp (2^-(mantissa bits + 1)) relative
        normal = inside & (np.abs(x) >= float(jnp.finfo(dtype).smallest_normal) * scale)
        assert (np.abs(back - x) <= rel[jnp.dtype(dtype)] * np.abs(x))[normal].all()
    assert dequantize(got, scale, jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=IDS[:2])
def test_fp8_overflow_gives_max_not_nan(dtype):
    """float8_e4m3fn has no inf: a plain cast of 1e6 is NaN; quantize clips first."""
    top = float(jnp.finfo(dtype).max)
    x = jnp.array([1e6, -1e6, 2 * top, jnp.inf, -jnp.inf, top, 0.0], jnp.float32)
    got = np.asarray(quantize(x, 1.0, dtype).astype(jnp.float32))
    np.testing.assert_array_equal(got, [top, -top, top, top, -top, top, 0.0])
    if dtype == jnp.float8_e4m3fn:
        assert np.isnan(np.asarray(jnp.float32(1e6).astype(dtype).astype(jnp.float32)))
    assert np.isnan(np.asarray(quantize(jnp.array([jnp.nan]), 1.0, dtype).astype(jnp.float32))).all()


def test_int8_rounds_half_to_even_and_clips_symmetric():
    x = jnp.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.4, 300.0, -128.0, -300.0, 0.49])
    got = np.asarray(quantize(x, 1.0, jnp.int8))
    np.testing.assert_array_equal(got, [0, 2, 2, 0, -2, -2, 126, 127, 127, -127, -127, 0])
    np.testing.assert_array_equal(np.asarray(quantize(x * 0.25, 0.25, jnp.int8)), got)


def test_quantize_refuses_float_dtypes():
    with pytest.raises(ValueError, match="expected one of"):
        quantize(jnp.ones(3), 1.0, jnp.bfloat16)
    with pytest.raises(ValueError, match="expected one of"):
        dequantize(jnp.ones(3), 1.0)


# ---- write_kv -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_write_kv_quantizes_with_each_heads_scales(dtype):
    rng = np.random.default_rng(1)
    num_pages, S, K, H = 6, 16, 3, 64
    kv_scale = np.array([[0.01, 0.2], [0.5, 0.03], [2.0, 1.0]], np.float32)
    cache = make_kv_cache(num_pages, S, K, H, dtype)
    slots = np.array([3 * S + 5, 1 * S + 0, 5 * S + 15, -1, num_pages * S + 2], np.int32)
    k = (rng.standard_normal((len(slots), K, H)) * kv_scale[:, 0, None] * 20).astype(np.float32)
    v = (rng.standard_normal((len(slots), K, H)) * kv_scale[:, 1, None] * 20).astype(np.float32)
    got = jax.jit(write_kv)(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots),
                            jnp.asarray(kv_scale))
    assert got.dtype == dtype
    got = np.asarray(got).reshape(num_pages, K, 2, S, H)
    want = np.zeros_like(got)
    for i, s in enumerate(slots[:3]):
        for h in range(K):
            want[s // S, h, 0, s % S] = _np_quantize(k[i, h], kv_scale[h, 0], dtype)
            want[s // S, h, 1, s % S] = _np_quantize(v[i, h], kv_scale[h, 1], dtype)
    np.testing.assert_array_equal(_bits(got), _bits(want))   # bad slots change nothing


def test_kv_scale_is_required_for_quantized_and_refused_for_float_caches():
    k = jnp.zeros((3, 2, 8))
    slots = jnp.zeros(3, jnp.int32)
    scale = jnp.ones((2, 2), jnp.float32)
    q8 = make_kv_cache(4, 16, 2, 8, jnp.int8)
    f32 = make_kv_cache(4, 16, 2, 8, jnp.float32)
    with pytest.raises(ValueError, match="needs kv_scale"):
        write_kv(q8, k, k, slots)
    with pytest.raises(ValueError, match="kv_scale given for a float32 cache"):
        write_kv(f32, k, k, slots, scale)
    with pytest.raises(ValueError, match=r"kv_scale shape \(2,\): expected \(2, 2\)"):
        write_kv(q8, k, k, slots, jnp.ones(2))
    args = (jnp.zeros((4, 4, 8)), q8, jnp.ones(2, jnp.int32), jnp.ones((2, 2), jnp.int32),
            jnp.array([0, 1, 2], jnp.int32), jnp.array([2], jnp.int32))
    with pytest.raises(ValueError, match="needs kv_scale"):
        ragged_paged_attention(*args, sm_scale=1.0, impl="reference")
    with pytest.raises(ValueError, match="kv_scale given for a float32 cache"):
        ragged_paged_attention(args[0], f32, *args[2:], sm_scale=1.0, impl="reference",
                               kv_scale=scale)


def test_float_cache_path_is_unchanged():
    """No scale ops for a float cache: the dispatcher's program is the impl's own."""
    from pallas_kernels.ragged_paged_attention import reference
    cache = make_kv_cache(4, 16, 2, 8, jnp.bfloat16)
    args = (jnp.zeros((4, 4, 8), jnp.bfloat16), cache, jnp.ones(2, jnp.int32),
            jnp.ones((2, 2), jnp.int32), jnp.array([0, 1, 2], jnp.int32), jnp.array([2], jnp.int32))
    via_dispatch = jax.make_jaxpr(functools.partial(ragged_paged_attention, sm_scale=0.5,
                                                    impl="reference"))(*args)
    direct = jax.make_jaxpr(functools.partial(reference.ragged_paged_attention, sm_scale=0.5))(*args)
    assert str(via_dispatch) == str(direct)


# ---- attention on quantized caches ----------------------------------------------------

S, K, G, H, T, R = 16, 2, 3, 64, 128, 8
# Magnitude of the data of each (kv head, K / V); the scales follow it per dtype.
MAG = np.array([[0.5, 2.0], [3.0, 0.25]], np.float32)
# Scale = MAG * this: int8 maps +-4 standard deviations to +-127; fp8 keeps the data
# well inside the normal range (e4m3 to 448, e5m2 to 57344).
SCALE_PER_MAG = {jnp.dtype(jnp.int8): 4 / 127, jnp.dtype(jnp.float8_e4m3fn): 1 / 64,
                 jnp.dtype(jnp.float8_e5m2): 1 / 64}
# Small TPU blocks: several items per request, several KV steps, window crossings.
SMALL_TPU = tpu.TpuConfig(block_q=4, rows=16, pages_per_step=2, kv_step=32, idx_window=4,
                          idx_align=2)


def _loose_bound(dtype) -> float:
    """Allowed relative RMS error of the output per kv head: twice the unit roundoff u
    of the stored values (fp8: 2^-(mantissa bits + 1); int8: half a step relative to
    the data's magnitude, 2 / 127 with these scales). K and V are each rounded by up
    to u (RMS about u / sqrt(3)); the errors of the scores and of V add up in the
    output to about that again (measured 0.4-0.75 u here), so 2u leaves room without
    hiding a wrong scale (a scale off by 2x for one head gives errors of order 1)."""
    u = {jnp.dtype(jnp.float8_e4m3fn): 2.0 ** -4, jnp.dtype(jnp.float8_e5m2): 2.0 ** -3,
         jnp.dtype(jnp.int8): 2 / 127}[jnp.dtype(dtype)]
    return 2 * u


@functools.lru_cache(maxsize=None)
def _case(dtype):
    batch = make_batch(scenarios(S)["mixed"], page_size=S, num_kv_heads=K, group=G, head_dim=H,
                       num_tokens=T, num_rows=R, pages_per_req=24, seed=5)
    batch.cache = batch.cache * MAG.reshape(-1)[None, :, None, None]     # NaN stays NaN
    unquantized = oracle(batch, sm_scale=H ** -0.5)
    q, cache, *rest = batch.args()
    kv_scale = jnp.asarray(MAG * SCALE_PER_MAG[jnp.dtype(dtype)])
    per_entry = kv_scale.reshape(-1)[None, :, None, None]                 # cache axis 1
    cache_q = quantize(cache, per_entry, dtype)
    dequantized = dequantize(cache_q, per_entry)
    same_math = np.asarray(ragged_paged_attention(q, dequantized, *rest, sm_scale=H ** -0.5,
                                                  impl="reference"))
    valid = np.arange(T) < batch.query_start_loc[batch.num_seqs[0]]
    return (q, cache_q, *rest), kv_scale, same_math, unquantized, valid


def _run(dtype, impl, interpret=False, q_dtype=jnp.float32):
    args, kv_scale, same_math, unquantized, valid = _case(dtype)
    fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=H ** -0.5, impl=impl,
                                   interpret=interpret))
    got = fn(args[0].astype(q_dtype), *args[1:], kv_scale=kv_scale)
    assert got.dtype == q_dtype
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all()
    assert not got[~valid].any()                        # padding tokens: zeros
    return got, same_math, unquantized, valid


def _check_quantization_error(got, unquantized, valid, dtype):
    err = (got - unquantized)[valid].reshape(-1, K, G, H)
    ref = unquantized[valid].reshape(-1, K, G, H)
    for h in range(K):
        rel_rms = np.sqrt((err[:, h] ** 2).mean() / (ref[:, h] ** 2).mean())
        assert rel_rms <= _loose_bound(dtype), (h, rel_rms)


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas_tpu_interpret"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_attention_on_quantized_cache(dtype, impl, monkeypatch):
    if impl == "pallas_tpu_interpret":
        monkeypatch.setattr(tpu, "choose_config", lambda *a: SMALL_TPU)
        impl, interpret = "pallas", True
    else:
        interpret = False
    got, same_math, unquantized, valid = _run(dtype, impl, interpret)
    np.testing.assert_allclose(got, same_math, atol=1e-5, rtol=1e-5)
    _check_quantization_error(got, unquantized, valid, dtype)


@pytest.mark.parametrize("interpret,dtype", [("tpu", jnp.float8_e4m3fn), ("gpu", jnp.float8_e4m3fn),
                                             ("gpu", jnp.int8)], ids=["tpu-e4m3", "gpu-e4m3", "gpu-int8"])
def test_kernels_with_bf16_queries(dtype, interpret):
    """The production form: bf16 q, tiles cast in the kernel (TPU: to bf16 in VMEM;
    GPU: fp8 to f16, int8 to bf16 in shared memory -- two code paths); bf16 rounding
    of q, P and the output bounds the difference from the float32 math. GPU interpret
    mode compiles each CTA on each call (seconds), so one batch each."""
    got, same_math, unquantized, valid = _run(dtype, "pallas", interpret, jnp.bfloat16)
    np.testing.assert_allclose(got, same_math, atol=3e-2, rtol=2e-2)
    _check_quantization_error(got, unquantized, valid, dtype)


# ---- the start-up check ---------------------------------------------------------------

SHAPE = dict(head_dim=128, num_heads=32, num_kv_heads=8, page_size=16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", *DTYPES])
def test_kv_cache_dtype_error_none_where_a_kernel_reads_it(dtype):
    for platform, backend in (("cpu", "auto"), ("cpu", "reference"), ("gpu", "auto"),
                              ("cuda", "pallas"), ("gpu", "xla"), ("tpu", "auto"),
                              ("cpu", "pallas_interpret")):
        assert kv_cache_dtype_error(dtype, platform=platform, backend=backend, **SHAPE) is None
    assert kv_cache_dtype_error(dtype, platform="tpu", backend="pallas", **SHAPE) is None


def test_kv_cache_dtype_error_names_the_gpu_fallbacks():
    gpu = dict(platform="gpu", backend="auto")
    why = kv_cache_dtype_error(jnp.int8, **gpu, **{**SHAPE, "page_size": 24})
    assert "page_size 24" in why and "attention_backend='xla'" in why
    assert kv_cache_dtype_error(jnp.bfloat16, **gpu, **{**SHAPE, "page_size": 64}) is None
    assert "float32" in kv_cache_dtype_error(jnp.float32, **gpu, **SHAPE)
    assert "head_dim 512" in kv_cache_dtype_error(jnp.float8_e4m3fn, **gpu,
                                                  **{**SHAPE, "head_dim": 512})
    assert "head_dim 512" in kv_cache_dtype_error(jnp.int8, **gpu, **{**SHAPE, "head_dim": 512})
    # Gemma 4's global layers: the kernel reads a 16-bit cache at head_dim 512.
    assert kv_cache_dtype_error(jnp.bfloat16, **gpu, **{**SHAPE, "head_dim": 512}) is None
    assert "head_dim 96 (64, 128, 256 or 512 only)" in kv_cache_dtype_error(
        jnp.bfloat16, **gpu, **{**SHAPE, "head_dim": 96})
    assert kv_cache_dtype_error(jnp.float32, platform="gpu", backend="xla", **SHAPE) is None
    assert "expected float32" in kv_cache_dtype_error("int4", platform="tpu", backend="auto",
                                                      **SHAPE)
    assert "not a multiple" in kv_cache_dtype_error(jnp.int8, platform="cpu", backend="auto",
                                                    **{**SHAPE, "num_kv_heads": 5})
