"""Weight quantization: linear-layer kernels stored as int8 or float8_e4m3fn with float32
scales, dequantized in the matmul.

A kernel [in..., out...] (models/layers.py: the first `num_contract` axes contract) is
seen as a matrix [I, O]. Its scale is float32 [ceil(I / block), out...]: one per output
channel and per `block` consecutive contraction rows (block None: all rows, one scale
per output channel), the real weight being q * scale. Per output channel is what
--quantization makes from an unquantized checkpoint; an FP8 block checkpoint (128 x 128
blocks) keeps its block scales, each output channel holding its block's, so both fit
one representation, the scale shards along the kernel's output axes, and a block need
not divide the shape.

Why not qwix (Google's JAX quantization library, evaluated for this): its PTQ
provider swaps parameters for wrapper objects it creates in `module.param` and whose
shape may not change, while these models read parameters directly (layers.py
`logical_param`) and reshape o_proj's kernel for its two-axis contraction; the loader
streams each leaf into a sharding derived from logical axis names, which qwix's
(qvalue, scale) leaves lack; and FP8 checkpoints must be loaded with their own block
scales, not quantized again from floats. What is needed here -- a scale layout, a
quantizer and a dequantizing matmul -- is the code below.

The same functions run on numpy (host, at load) and jax.numpy (device, dummy weights
and the matmul): `xp` picks.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from models.config import WeightQuant
from pallas_kernels.ragged_paged_attention.quant import quantize as quantize_with_scale

SCALE_SUFFIX = "_scale"   # a quantized kernel "k" has its scale in param "k_scale"


def storage_dtype(quant: WeightQuant) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, quant.dtype_name, None) or quant.dtype_name)


def qmax(dtype: Any) -> float:
    """Largest magnitude stored: 127 for int8 (symmetric), the finite max for fp8."""
    dtype = np.dtype(dtype)
    return 127.0 if dtype == np.int8 else float(ml_dtypes.finfo(dtype).max)


def scale_shape(kernel_shape: tuple[int, ...], num_contract: int, block: int | None
                ) -> tuple[int, ...]:
    rows = math.prod(kernel_shape[:num_contract])
    blocks = 1 if block is None else -(-rows // block)
    return (blocks, *kernel_shape[num_contract:])


def _row_scales(scale: Any, rows: int, block: int | None, xp: Any) -> Any:
    """scale [B, O] -> [rows, O]: each row its block's (one block: [1, O], broadcast)."""
    if scale.shape[0] == 1:
        return scale
    return xp.repeat(scale, block, axis=0)[:rows]


def quantize(w: Any, dtype: Any, num_contract: int, block: int | None, xp: Any = np
             ) -> tuple[Any, Any]:
    """(q, scale) for kernel w: scale = absmax of each block / qmax (1 where a block is
    all zeros), q = w / scale rounded (int8) or cast (fp8) after clipping to +-qmax --
    float8_e4m3fn has no infinity, an overflow would be NaN."""
    shape = w.shape
    rows = math.prod(shape[:num_contract])
    w2 = xp.asarray(w, dtype=np.float32).reshape(rows, -1)
    b = rows if block is None else block
    nblocks = -(-rows // b)
    padded = w2 if nblocks * b == rows else xp.concatenate(
        [w2, xp.zeros((nblocks * b - rows, w2.shape[1]), np.float32)])
    absmax = xp.max(xp.abs(padded.reshape(nblocks, b, -1)), axis=1)          # [B, O]
    top = qmax(dtype)
    scale = xp.where(absmax > 0, absmax / top, 1.0).astype(np.float32)
    x = xp.clip(w2 / _row_scales(scale, rows, block, xp), -top, top)
    if np.dtype(dtype) == np.int8:
        x = xp.round(x)
    q = x.astype(dtype).reshape(shape)
    return q, scale.reshape(scale_shape(shape, num_contract, block))


def dequantize(q: Any, scale: Any, num_contract: int, block: int | None, dtype: Any,
               xp: Any = jnp) -> Any:
    """The real kernel q * scale, in `dtype` (arithmetic in float32)."""
    rows = math.prod(q.shape[:num_contract])
    w = q.astype(np.float32).reshape(rows, -1) * _row_scales(
        scale.reshape(scale.shape[0], -1), rows, block, xp)
    return w.astype(dtype).reshape(q.shape)


def quantize_rows(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Dynamic activation quantization: each row (token) of x [..., I] in `dtype` with its
    own float32 scale [..., 1] (absmax / qmax), computed in the step."""
    absmax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / qmax(dtype), 1.0)
    return quantize_with_scale(x, scale, dtype), scale


def int_or_float_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b of two quantized operands in their own dtype: int8 x int8 accumulates in
    int32 (exact), fp8 x fp8 in float32; as float32."""
    acc = jnp.int32 if a.dtype == jnp.int8 else jnp.float32
    return jnp.dot(a, b, preferred_element_type=acc).astype(jnp.float32)


def quantized_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, num_contract: int,
                     block: int | None, dtype: Any, out_dtype: Any = None,
                     dynamic_activations: bool = False) -> jax.Array:
    """x [..., in...] @ the kernel q * scale -> [..., out...], computed in `dtype`.

    One scale per output channel: the scale multiplies the matmul's output (exact, and
    the kernel is only converted, which XLA fuses into the dot's operand). Block scales:
    the kernel is dequantized first (XLA fuses that into the operand as well).
    dynamic_activations (per-channel scales only): x is quantized per token to the
    kernel's dtype and the product runs in that dtype (w8a8: int8 or fp8 matmul units),
    both scales applied to the output."""
    n = num_contract
    out_shape = q.shape[n:]
    x2 = x.astype(dtype).reshape(*x.shape[:x.ndim - n], -1)
    q2 = q.reshape(-1, math.prod(out_shape))
    if dynamic_activations:
        if scale.shape[0] != 1:
            raise ValueError("dynamic activation quantization needs per-output-channel "
                             "weight scales, not block scales")
        xq, x_scale = quantize_rows(x2, q.dtype)
        y = (int_or_float_dot(xq, q2) * x_scale * scale.reshape(-1)).astype(out_dtype or dtype)
    elif scale.shape[0] == 1:
        y = jnp.dot(x2, q2.astype(dtype), preferred_element_type=jnp.float32)
        y = y * scale.reshape(-1)
        y = y.astype(out_dtype or dtype)
    else:
        w = dequantize(q, scale, n, block, dtype).reshape(-1, math.prod(out_shape))
        y = jnp.dot(x2, w, preferred_element_type=out_dtype)
    return y.reshape(*y.shape[:-1], *out_shape)
