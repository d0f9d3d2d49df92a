"""ragged_paged_attention: one entry point over the reference and the two kernels.

impl="reference": the pure-jnp spec (reference.py), any platform.
impl="xla": a page-by-page online-softmax loop in plain XLA (paged_loop.py), the
  fast path on CPU (the engine's "auto" there).
impl="pallas": the kernel for the platform the computation is *lowered* for,
  chosen with lax.platform_dependent, so jax.export(..., platforms=["cuda"])
  and platforms=["tpu"] both work from a CPU-only machine:
    cuda -> gpu.py (Mosaic GPU) when gpu.supports(...) (bf16/f16 at head_dim
            64/128/256/512, fp8/int8 at 64/128/256), else the reference
            (kv_cache_dtype_error says so, for the engine's start-up, which refuses
            or logs it: jaxserve/build/kernel_choice.py; traced on a GPU, the
            fallback is also logged here);
    tpu  -> tpu.py (Mosaic TPU);
    anything else (cpu, rocm) -> the reference.
  interpret=True (or "tpu") runs the TPU kernel body in Pallas TPU interpret
  mode, interpret="gpu" the Mosaic GPU body in GPU interpret mode; both run
  on CPU. The TPU body is the default because TPU interpret mode runs every
  kernel feature and is fast; GPU interpret mode compiles each CTA separately
  (seconds each) and lacks WGMMA on transposed/register operands (see gpu.py).
The kernels compute in the cache dtype (q is cast to it; the output comes back
in q's dtype) with float32 softmax statistics and accumulators.
Quantized caches (fp8 / int8, quant.py) come with kv_scale float32[K, 2]; the
scales fold out of every impl here: q is multiplied by its kv head's K scale
before (in float32, then back to q's dtype), the output by its V scale after,
so an impl only reads the narrow cache and casts K/V tiles after loading them:
reference and xla compute in float32 as always, the TPU kernel in q's dtype,
the GPU kernel in f16 for fp8 and q's 16-bit dtype for int8 (gpu.compute_dtype).
A float cache takes no kv_scale and runs exactly as before.
Multi-platform export (e.g. platforms=["cpu", "cuda"]) is not possible: jax
0.10.2 cannot lower a Mosaic GPU kernel inside a multi-platform module.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from pallas_kernels.ragged_paged_attention import gpu, paged_loop, reference, tpu
from pallas_kernels.held_dtypes import as_values
from pallas_kernels.ragged_paged_attention.cache import cache_dims, check_kv_scale
from pallas_kernels.ragged_paged_attention.quant import is_quantized

logger = logging.getLogger(__name__)

IMPLS = ("pallas", "xla", "reference")
# Engine-level names (EngineConfig.attention_backend) -> (impl, interpret).
BACKENDS = {
    "reference": ("reference", False),
    "xla": ("xla", False),
    "pallas": ("pallas", False),
    "pallas_interpret": ("pallas", True),
}


def resolve_backend(backend: str, platform: str | None = None) -> str:
    """An attention backend name with "auto" resolved -- the one place that says what
    it means: the Pallas kernels on GPU/TPU, the XLA page loop elsewhere (platform
    defaults to jax.default_backend())."""
    if backend == "auto":
        platform = platform or jax.default_backend()
        backend = "pallas" if platform in ("gpu", "cuda", "tpu") else "xla"
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: expected 'auto' or one of {tuple(BACKENDS)}")
    return backend


def backend_options(backend: str) -> tuple[str, bool]:
    """(impl, interpret) to pass to ragged_paged_attention for a backend name."""
    return BACKENDS[resolve_backend(backend)]


def _validate(q, cache, kv_lens, page_table, query_start_loc, num_seqs, sliding_window, soft_cap):
    _, _, num_kv, head_dim = cache_dims(cache)
    if q.ndim != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q shape {q.shape}: expected [T, N, {head_dim}]")
    if q.shape[1] % num_kv:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {num_kv} kv heads")
    rows = kv_lens.shape[0]
    if kv_lens.shape != (rows,) or page_table.ndim != 2 or page_table.shape[0] != rows:
        raise ValueError(f"kv_lens {kv_lens.shape} / page_table {page_table.shape}: expected [R], [R, P]")
    if query_start_loc.shape != (rows + 1,):
        raise ValueError(f"query_start_loc shape {query_start_loc.shape}: expected ({rows + 1},)")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs shape {num_seqs.shape}: expected (1,)")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window}: must be >= 1")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap={soft_cap}: must be > 0")


def ragged_paged_attention(
    q: jax.Array,                 # [T, N, H]
    cache: jax.Array,             # [num_pages, 2K, S, H] from make_kv_cache
    kv_lens: jax.Array,           # int32[R] KV length after this step
    page_table: jax.Array,        # int32[R, P]
    query_start_loc: jax.Array,   # int32[R + 1]
    num_seqs: jax.Array,          # int32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    impl: str = "pallas",
    interpret: bool | str = False,
    kv_scale: jax.Array | None = None,   # float32[K, 2] for a quantized cache (quant.py)
    horizon: jax.Array | None = None,    # int32[T] the last position each token sees
) -> jax.Array:                   # [T, N, H]
    """Causal attention of each packed token over its own request's pages (see reference.py;
    horizon: Gemma 4's image tokens see their whole image)."""
    _validate(q, cache, kv_lens, page_table, query_start_loc, num_seqs, sliding_window, soft_cap)
    check_kv_scale(cache, kv_scale)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, impl=impl,
              interpret=interpret, horizon=horizon)
    if kv_scale is None:
        return _attend(q, cache, kv_lens, page_table, query_start_loc, num_seqs, **kw)
    # Query head n reads kv head n // G: its scales, repeated per head of the group.
    scale = jnp.repeat(kv_scale.astype(jnp.float32), q.shape[1] // kv_scale.shape[0], axis=0)
    k_scale, v_scale = scale[:, 0, None], scale[:, 1, None]            # [N, 1]
    q = (q.astype(jnp.float32) * k_scale).astype(q.dtype)
    out = _attend(q, cache, kv_lens, page_table, query_start_loc, num_seqs, **kw)
    return (out.astype(jnp.float32) * v_scale).astype(q.dtype)


def _attend(q, cache, kv_lens, page_table, query_start_loc, num_seqs, *, sm_scale, sliding_window,
            soft_cap, impl, interpret, horizon=None):
    """The impl on a cache whose values are used as stored (scales already folded)."""
    args = (q, cache, kv_lens.astype(jnp.int32), page_table.astype(jnp.int32),
            query_start_loc.astype(jnp.int32), num_seqs.astype(jnp.int32))
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
              horizon=None if horizon is None else horizon.astype(jnp.int32))
    if impl == "reference":
        return reference.ragged_paged_attention(*args, **kw)
    if impl == "xla":
        return paged_loop.ragged_paged_attention(*args, **kw)
    if impl != "pallas":
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    # The kernels read float caches as they are: one held as bits (a CPU engine's,
    # pallas_kernels/held_dtypes.py) is turned back whole, which only the CPU's interpret-mode
    # runs of the kernels meet.
    cache = as_values(cache)
    args = (q, cache, *args[2:])

    _, page_size, num_kv, head_dim = cache_dims(cache)
    gpu_ok = gpu.supports(cache.dtype, head_dim, q.shape[1], num_kv, page_size)
    if interpret in (True, "tpu"):
        from jax.experimental.pallas import tpu as pltpu
        return tpu.ragged_paged_attention_tpu(*args, **kw, interpret=pltpu.InterpretParams())
    if interpret == "gpu":
        if not gpu_ok:
            raise ValueError(f"the Mosaic GPU kernel does not support dtype {cache.dtype}, "
                             f"head_dim {head_dim}, page_size {page_size}")
        return gpu.ragged_paged_attention_gpu(*args, **kw, interpret=gpu.interpret_params())
    if interpret is not False:
        raise ValueError(f"interpret={interpret!r}: expected False, True, 'tpu' or 'gpu'")

    if not gpu_ok and jax.default_backend() == "gpu":   # never a silent fallback
        logger.warning("ragged_paged_attention(impl='pallas') on this GPU runs the jnp "
                       "reference: %s", kv_cache_dtype_error(
                           cache.dtype, platform="gpu", backend="pallas", head_dim=head_dim,
                           num_heads=q.shape[1], num_kv_heads=num_kv, page_size=page_size))
    ref = lambda *a: reference.ragged_paged_attention(*a, **kw)
    on_gpu = (lambda *a: gpu.ragged_paged_attention_gpu(*a, **kw)) if gpu_ok else ref
    on_tpu = lambda *a: tpu.ragged_paged_attention_tpu(*a, **kw)
    return lax.platform_dependent(*args, cuda=on_gpu, tpu=on_tpu, default=ref)


_FLOAT_CACHE_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


def kv_cache_dtype_error(kv_dtype: DTypeLike, *, platform: str, backend: str, head_dim: int,
                         num_heads: int,                         num_kv_heads: int, page_size: int) -> str | None:
    """Why this engine would not read a cache of kv_dtype with attention `backend`
    ("auto" resolved for `platform`: "cpu", "gpu"/"cuda", "tpu") -- including the
    silent fallback of impl="pallas" to the reference -- with the fix; None when it
    works. For the engine's start-up, so no combination falls back silently.

    TPU: the kernel compiles with fp8 (e4m3, e5m2) and int8 caches for v4, v5e, v5p
    and v6e (libtpu's deviceless compiler; v5e and v6e in
    tests/kernels/test_kv_quant_compile.py), fp8 too on chips without fp8
    arithmetic (the kernel casts tiles to q's dtype), so no TPU generation is refused.
    """
    try:
        dtype = jnp.dtype(kv_dtype)
    except TypeError:
        return f"kv cache dtype {kv_dtype!r} is not a dtype"
    if dtype not in _FLOAT_CACHE_DTYPES and not is_quantized(dtype):
        return (f"kv cache dtype {dtype}: expected float32, bfloat16, float16, float8_e4m3fn, "
                f"float8_e5m2 or int8")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads"
    impl, interpret = backend_options(resolve_backend(backend, platform))
    if impl != "pallas" or interpret or platform not in ("gpu", "cuda"):
        return None       # reference, XLA loop and the TPU kernel read every cache dtype
    if gpu.supports(dtype, head_dim, num_heads, num_kv_heads, page_size):
        return None
    group = num_heads // num_kv_heads
    if dtype == jnp.float32:
        why = "float32 (WGMMA would run it as TF32)"
    elif head_dim not in gpu.HEAD_DIMS:
        why = f"head_dim {head_dim} (64, 128, 256 or 512 only)"
    elif is_quantized(dtype) and head_dim > gpu.MAX_COLS:
        why = (f"head_dim {head_dim} with a {dtype} cache (its KV steps of 32 tokens are "
               f"shorter than the {gpu.ROWS}-row tiles the quantized cast needs; bfloat16 "
               f"or float16 only)")
    elif group > gpu.ROWS:
        why = f"{group} query heads per kv head (at most {gpu.ROWS})"
    else:
        why = (f"page_size {page_size} for {dtype} caches (its KV steps must be a multiple "
               f"of {gpu.ROWS} tokens: page sizes that divide or are multiples of 128)")
    return (f"the Mosaic GPU attention kernel cannot read this cache: {why}; "
            f"impl='pallas' would fall back to the slow XLA reference. Use "
            f"attention_backend='xla' (the page loop) or a cache it reads (bfloat16 or "
            f"float16 at head_dim 64/128/256/512, fp8 or int8 at 64/128/256)")
