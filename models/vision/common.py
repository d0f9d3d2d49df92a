"""Pieces both vision towers use: norms, rotary halves, masked attention, reading the
tower's tensors from a checkpoint. Pure functions over dicts of arrays (no Flax module):
a tower is a handful of matmuls, and the engine jits it as its own program.

Glossary (docs/CONVENTIONS.md) plus P patches, D patch pixels, C vision hidden.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

Params = dict[str, Any]
_FLOATS = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), np.dtype(ml_dtypes.bfloat16)}


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """torch's LayerNorm, in float32."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    """x * (mean(x^2) + eps)^-1/2 * w (plain w; none: no weight), in float32."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
    return (y if w is None else y * w.astype(jnp.float32)).astype(x.dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def axial_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """The axial 2-D RoPE's frequencies: head_dim // 4 of them, shared by both axes
    (each axis rotates half the head)."""
    spatial = head_dim // 2
    return (1.0 / theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial)).astype(np.float32)


# Patches per block of the towers' attention, for queries and keys alike: over more
# patches, one (query block, key block) tile of scores [heads, block, block] lives at a
# time instead of [heads, patches, patches] (16 heads x 65536 patches, the published
# 16-megapixel maximum, would be 256 GiB of float32 scores). At 1024, libtpu keeps a
# tile's scores in VMEM.
QUERY_BLOCK = 1024
_MASKED = float(jnp.finfo(jnp.float32).min)   # a key the query may not see (as torch)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment: jax.Array,
              k_segment: jax.Array, scale: float, block: int | None = None) -> jax.Array:
    """Softmax attention over [..., T, N, H] q and [..., T, K, H] k/v (N a multiple of
    K): a query sees a key when their segments ([..., T] int) are equal and the key's is
    not negative (a query that sees no key averages every key, as torch's masked softmax
    does; such rows are padding). Probabilities in float32. Over T > block (default
    QUERY_BLOCK) patches, flash-style: equal blocks of at most `block` queries one after
    another, each over equal blocks of keys with a running maximum and sum (online
    softmax), the mask built per tile from the segments, tiles where no query sees a key
    skipped; the result is the unblocked one's up to float rounding."""
    groups = q.shape[-2] // k.shape[-2]
    if groups > 1:
        k, v = jnp.repeat(k, groups, axis=-2), jnp.repeat(v, groups, axis=-2)
    t = q.shape[-3]
    size = query_block(t, block)
    if size == t:
        return _attend(q, k, v, _visible(q_segment, k_segment), scale)
    n = -(-t // size)
    pad = n * size - t   # padding queries are dropped; padding keys are never seen
    blocks = lambda x, axis: jnp.moveaxis(            # [..., n * size, ...] -> [n, ..., size, ...]
        x.reshape(*x.shape[:axis], n, size, *x.shape[axis + 1:]), axis, 0)
    padded = lambda x, axis, fill: jnp.pad(
        x, [(0, pad) if a == axis % x.ndim else (0, 0) for a in range(x.ndim)], constant_values=fill)
    qs, ks, vs = (blocks(padded(x, -3, 0), q.ndim - 3) for x in (q, k, v))
    q_seg, k_seg = (blocks(padded(s, -1, -1), s.ndim - 1) for s in (q_segment, k_segment))
    real = np.arange(n * size).reshape(n, size) < t                     # [n, size] keys

    def query_tile(args: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        qb, qsb, sees = args
        lead = qb.shape[:-3]
        init = (jnp.full((*lead, qb.shape[-2], size), -jnp.inf, jnp.float32),   # running max
                jnp.zeros((*lead, qb.shape[-2], size), jnp.float32),           # running sum
                jnp.zeros(qb.shape, jnp.float32))                               # sum of p v
        # A query that sees no key at all averages every key, so a block holding one
        # (padding) runs every tile; the others skip the tiles where no query of the block
        # sees a key (other images' patches, padding keys): those add exactly nothing.
        every_tile = ~sees.all()

        def key_tile(carry, kv):
            kb, vb, ksb, kreal = kv
            visible = _visible(qsb, ksb)

            def run(carry):
                top, total, acc = carry
                logits = jnp.einsum("...tnh,...snh->...nts", qb, kb,
                                    preferred_element_type=jnp.float32) * scale
                logits = jnp.where(visible[..., None, :, :], logits, _MASKED)
                logits = jnp.where(kreal, logits, -jnp.inf)   # the first tile has real keys
                new_top = jnp.maximum(top, logits.max(-1))
                probs = jnp.exp(logits - new_top[..., None])
                rescale = jnp.exp(top - new_top)
                total = total * rescale + probs.sum(-1)
                acc = acc * jnp.swapaxes(rescale, -1, -2)[..., None] + jnp.einsum(
                    "...nts,...snh->...tnh", probs.astype(vb.dtype), vb,
                    preferred_element_type=jnp.float32)
                return new_top, total, acc

            return jax.lax.cond(every_tile | visible.any(), run, lambda c: c, carry), None

        (_, total, acc), _ = jax.lax.scan(key_tile, init, (ks, vs, k_seg, jnp.asarray(real)))
        return (acc / jnp.swapaxes(total, -1, -2)[..., None]).astype(v.dtype)

    sees = blocks(padded(_sees_some_key(q_segment, k_segment), -1, True), q_segment.ndim - 1)
    out = jnp.moveaxis(jax.lax.map(query_tile, (qs, q_seg, sees)), 0, -4)
    return out.reshape(*out.shape[:-4], n * size, *out.shape[-2:])[..., :t, :, :]


def query_block(t: int, block: int | None = None) -> int:
    """The patches in each of attention's blocks (queries, and keys) over t patches: all
    t up to `block` (default QUERY_BLOCK), else as few equal blocks of at most `block`
    as cover them."""
    block = block or QUERY_BLOCK
    return t if t <= block else -(-t // -(-t // block))


def _sees_some_key(q_segment: jax.Array, k_segment: jax.Array) -> jax.Array:
    """[..., Q] bool: whether each query sees at least one key (its segment is among the
    real keys'), by a search in the sorted key segments: no [Q, K] mask."""
    never = jnp.iinfo(jnp.int32).max
    keys = jnp.sort(jnp.where(k_segment >= 0, k_segment, never).astype(jnp.int32), axis=-1)
    flat_k = keys.reshape(-1, keys.shape[-1])
    flat_q = jnp.broadcast_to(q_segment, (*keys.shape[:-1], q_segment.shape[-1])).reshape(
        flat_k.shape[0], -1).astype(jnp.int32)
    at = jnp.minimum(jax.vmap(jnp.searchsorted)(flat_k, flat_q), flat_k.shape[-1] - 1)
    found = (jnp.take_along_axis(flat_k, at, -1) == flat_q) & (flat_q >= 0)
    return found.reshape(*keys.shape[:-1], q_segment.shape[-1])


def _visible(q_segment: jax.Array, k_segment: jax.Array) -> jax.Array:
    """[..., Q, K]: True where a query may see a key (same segment, a real key)."""
    return (q_segment[..., :, None] == k_segment[..., None, :]) & (k_segment[..., None, :] >= 0)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float
            ) -> jax.Array:
    """attention of queries [..., Q, N, H] over keys [..., T, N, H], mask [..., Q, T]."""
    logits = jnp.einsum("...tnh,...snh->...nts", q, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask[..., None, :, :], logits, _MASKED)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("...nts,...snh->...tnh", probs, v)


def read_tensors(model_dir: str | Path, prefixes: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Every checkpoint tensor whose name starts with one of `prefixes`, as float32
    numpy arrays (a tower is small next to its text model: read it whole)."""
    from models.weights import _open_checkpoint  # the checkpoint's shard layout has one owner
    where = _open_checkpoint(Path(model_dir))
    names = [name for name in where if name.startswith(prefixes)]
    for name in names:
        # a quantized tower (float8 or int weights with their scales) would load as raw
        # codes: refuse it rather than encode garbage
        if where[name].dtype(name) not in _FLOATS:
            raise ValueError(f"vision tensor {name!r} is stored as {where[name].dtype(name)}; "
                             f"quantized vision towers are not supported")
    out = {name: np.asarray(where[name].get(name), dtype=np.float32) for name in names}
    if not out:
        raise ValueError(f"{str(model_dir)!r} holds no vision tower (no tensor under "
                         f"{', '.join(prefixes)})")
    return out


def linear(w: np.ndarray) -> np.ndarray:
    """An HF [out, in] weight as our [in, out] kernel."""
    return np.ascontiguousarray(w.T)


def count_params(model_dir: str | Path, prefixes: tuple[str, ...]) -> int:
    """How many parameters the checkpoint stores under `prefixes` (from the safetensors
    headers: no tensor is read)."""
    from models.weights import _open_checkpoint  # the checkpoint's shard layout has one owner
    where = _open_checkpoint(Path(model_dir))
    return sum(int(np.prod(where[n].shape(n))) for n in where if n.startswith(prefixes))


def stack(tensors: dict[str, np.ndarray], template: str, count: int) -> np.ndarray:
    """The `count` per-layer tensors named template.format(i), stacked on a new axis 0
    (the towers scan over their layers)."""
    return np.stack([need(tensors, template.format(i)) for i in range(count)])


def to_device(params: Params, dtype: Any) -> Params:
    """Float leaves in `dtype`, integer leaves as they are."""
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(a, dtype if np.issubdtype(a.dtype, np.floating) else a.dtype), params)


def need(tensors: dict[str, np.ndarray], name: str) -> np.ndarray:
    if name not in tensors:
        raise ValueError(f"checkpoint lacks vision tensor {name!r}")
    return tensors[name]
