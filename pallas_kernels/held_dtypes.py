"""How the engine's big per-layer arrays (KV caches, conv states) are held on each platform.

XLA:CPU has no 16- or 8-bit float arithmetic: it compiles an update (a scatter) of a
bfloat16 / float16 / fp8 array as "convert the whole array to float32, update, convert
back" -- whole-array passes per layer and step, 60x slower than float32 on a small
model. It updates integer arrays of the same width in place. So on CPU such an array
is held as its bit patterns, the integer type saying which float they are (uint16:
bfloat16, int16: float16, uint8: float8_e4m3fn; int8 is the int8 KV cache and
float8_e5m2 has no integer type left, so it stays slow and the runner warns).
Writers store bits (as_held), readers turn only the rows they gathered back into
values (as_values: a bitcast inside their fusion, no pass over the array).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

_BITS = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16),
         jnp.dtype(jnp.float16): jnp.dtype(jnp.int16),
         jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.uint8)}
_VALUES = {bits: value for value, bits in _BITS.items()}


def held_dtype(dtype: DTypeLike, platform: str) -> jnp.dtype:
    """The dtype an array of `dtype` values is held in on `platform`."""
    dtype = jnp.dtype(dtype)
    return _BITS.get(dtype, dtype) if platform == "cpu" else dtype


def value_dtype(dtype: DTypeLike) -> jnp.dtype:
    """The dtype of the values an array held in `dtype` stores."""
    dtype = jnp.dtype(dtype)
    return _VALUES.get(dtype, dtype)


def as_values(x: jax.Array) -> jax.Array:
    """Entries of a held array (or rows gathered from one) as the values they store."""
    value = value_dtype(x.dtype)
    return x if value == x.dtype else jax.lax.bitcast_convert_type(x, value)


def as_held(x: jax.Array, held: DTypeLike) -> jax.Array:
    """Values to write into an array held in `held`: cast to its values' dtype, then
    as bits when it holds bits."""
    held = jnp.dtype(held)
    x = x.astype(value_dtype(held))
    return x if x.dtype == held else jax.lax.bitcast_convert_type(x, held)


@functools.cache
def cpu_has_bf16_dot() -> bool:
    """Whether this host's CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16),
    where XLA:CPU's bf16 x bf16 -> float32 dot runs ~2x a float32 one (issue 38); without
    it the bf16 dot is emulated and slower than a float32 one on the same values."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
