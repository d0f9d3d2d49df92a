"""The batched LoRA op: every token's low-rank delta from its own adapter, in one step.

The adapters live stacked in S slots (slot 0 = no adapter, zeros; models/lora/slots.py):
A [S, I, R], B [S, R, O], padded to the rank R. Tokens are sorted by slot once per step
(group_by_slot), then each projection's delta is two grouped matmuls over the sorted
tokens (jax.lax.ragged_dot: each token's row meets only its own slot's matrix, as
Punica's SGMV and S-LoRA do) instead of gathering a whole [I, R] matrix per token.

Under a mesh the delta follows its base projection (sharded_lora_delta):
  - column-parallel base (q/k/v, gate/up: output split over the model axis): B split on
    its output, the delta comes out split like the base's output; no collective;
  - row-parallel base (o, down: input split): A split on its input, the [T, R] partial
    products summed over the model axis (R numbers a token: far less than the base's
    all-reduce of [T, O]), B replicated; the delta comes out replicated.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from sharding.mesh import MODEL
from sharding.parallel import context_model_axis_size, heads_spec, over_model_axis

# The forward's variable collections (models/lora/slots.forward_variables, read by
# models/layers.Einsum): the stacks, and the step's grouping under every adapted module.
LORA, LORA_STEP = "lora", "lora_step"
# How a projection's delta is split under the mesh (sharded_lora_delta).
SPLIT_IN, SPLIT_OUT = "in", "out"   # None: replicated


def projection_split(axes: tuple, num_contract: int, rules: dict) -> str | None:
    """How a kernel with logical `axes` (its first num_contract contracted) is split on
    the model axis under `rules` (logical axis -> mesh axis): SPLIT_OUT, SPLIT_IN or None."""
    split = [rules.get(a) is not None for a in axes]
    if split[num_contract:][:1] == [True]:
        return SPLIT_OUT
    if split[:1] == [True]:
        return SPLIT_IN
    if any(split):   # an inner axis split: the merged axis would not split in blocks
        raise ValueError(f"LoRA cannot follow a kernel split on an inner axis: {axes}")
    return None


class SlotGroups(NamedTuple):
    """The step's tokens grouped by adapter slot, computed once and shared by every
    projection of every layer."""
    order: jax.Array         # int32[T]: token indices sorted by slot (stable)
    group_sizes: jax.Array   # int32[S]: tokens of each slot
    token_slots: jax.Array   # int32[T]: each token's slot, in sorted order
    inverse: jax.Array       # int32[T]: where each token sits in the sorted order


def group_by_slot(slot_ids: jax.Array, num_slots: int) -> SlotGroups:
    """slot_ids int32[T], each in [0, num_slots) (padding tokens: 0)."""
    slot_ids = slot_ids.astype(jnp.int32)
    order = jnp.argsort(slot_ids, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(slot_ids, length=num_slots).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    return SlotGroups(order, sizes, slot_ids[order], inverse)


def _grouped_delta(x: jax.Array, groups: SlotGroups, a: jax.Array, b: jax.Array,
                   scales: jax.Array, sum_axis: str | None = None) -> jax.Array:
    """x [T, I] -> delta [T, O] = scale[s] * (x @ A[s]) @ B[s], s the token's slot: by
    XLA's ragged dot where it is native (TPU, GPU), by sorted tiles on XLA:CPU, whose
    ragged dot runs every group over all the tokens (chosen when lowering)."""
    return jax.lax.platform_dependent(
        x, groups, a, b, scales, cpu=partial(_tiled_delta, sum_axis=sum_axis),
        default=partial(_ragged_delta, sum_axis=sum_axis))


def _ragged_delta(x: jax.Array, groups: SlotGroups, a: jax.Array, b: jax.Array,
                  scales: jax.Array, sum_axis: str | None = None) -> jax.Array:
    xs = jnp.take(x, groups.order, axis=0)
    h = jax.lax.ragged_dot(xs.astype(a.dtype), a, groups.group_sizes,
                           preferred_element_type=jnp.float32)          # [T, R]
    if sum_axis is not None:   # row-parallel: each device had a slice of I
        h = jax.lax.psum(h, sum_axis)
    h = h * jnp.take(scales.astype(jnp.float32), groups.token_slots)[:, None]
    y = jax.lax.ragged_dot(h.astype(b.dtype), b, groups.group_sizes,
                           preferred_element_type=jnp.float32)          # [T, O]
    return jnp.take(y, groups.inverse, axis=0).astype(x.dtype)   # back to the tokens' order


def cpu_tile(num_tokens: int, num_slots: int) -> int:
    """Rows per tile of the CPU form: at most 16, small enough that the padding of the
    adapters' last tiles ((S - 1) x tile rows at most) stays within the step's tokens."""
    t = max(1, num_tokens // max(num_slots - 1, 1))
    return min(16, 1 << (t.bit_length() - 1))


def _tiled_delta(x: jax.Array, groups: SlotGroups, a: jax.Array, b: jax.Array,
                 scales: jax.Array, sum_axis: str | None = None) -> jax.Array:
    """The CPU form: the sorted tokens of each adapter (slot 0's skipped: no delta) laid
    in tiles of one slot each, one slot's A and B gathered per tile, so the work grows
    with T + S x tile rows, not T x S."""
    (T, I), S, O = x.shape, a.shape[0], b.shape[-1]
    tile = cpu_tile(T, S)
    n_tiles = -(-T // tile) + S - 1                        # a static bound on the tiles used
    sizes = groups.group_sizes.at[0].set(0)
    tiles = (sizes + tile - 1) // tile
    tiles_end = jnp.cumsum(tiles)
    seg_start = jnp.cumsum(groups.group_sizes) - groups.group_sizes
    slot = groups.token_slots                              # sorted order
    row = jnp.where(slot == 0, n_tiles * tile,             # the zero row past the tiles
                    (tiles_end - tiles)[slot] * tile + jnp.arange(T) - seg_start[slot])
    row = jnp.take(row, groups.inverse)                    # per token, in its order
    src = jnp.full(n_tiles * tile + 1, T, jnp.int32).at[row].set(jnp.arange(T, dtype=jnp.int32))
    k = jnp.arange(n_tiles)
    tile_slot = jnp.where(k < tiles_end[-1], jnp.searchsorted(tiles_end, k, side="right"), 0)
    xp = jnp.concatenate([x, jnp.zeros((1, I), x.dtype)])[src[:-1]].reshape(n_tiles, tile, I)
    h = jnp.einsum("kti,kir->ktr", xp.astype(a.dtype), a[tile_slot],
                   preferred_element_type=jnp.float32)
    if sum_axis is not None:
        h = jax.lax.psum(h, sum_axis)
    h = h * scales.astype(jnp.float32)[tile_slot][:, None, None]
    y = jnp.einsum("ktr,kro->kto", h.astype(b.dtype), b[tile_slot],
                   preferred_element_type=jnp.float32).reshape(-1, O)
    return jnp.concatenate([y, jnp.zeros((1, O), y.dtype)])[row].astype(x.dtype)


def lora_delta(x: jax.Array, groups: SlotGroups, a: jax.Array, b: jax.Array,
               scales: jax.Array) -> jax.Array:
    """The LoRA delta of one projection for a batch mixing adapters.

    x [T, I] (the projection's input, contraction axes merged), groups from
    group_by_slot, a [S, I, R], b [S, R, O], scales float32[S] (alpha / r, or
    alpha / sqrt(r) with rsLoRA; anything for slot 0, whose matrices are zero).
    Returns [T, O] in x's dtype, to add to the base projection's output."""
    return _grouped_delta(x, groups, a, b, scales)


def sharded_lora_delta(x: jax.Array, groups: SlotGroups, a: jax.Array, b: jax.Array,
                       scales: jax.Array, split: str | None) -> jax.Array:
    """lora_delta under the context mesh's model axis, split as its base projection
    (module docstring): split "out": B split on O, the delta split on O; "in": x and A
    split on I, the delta replicated; None: all replicated. Without a mesh (or one
    device on the model axis) this is lora_delta."""
    rep = PartitionSpec()
    g = SlotGroups(rep, rep, rep, rep)
    if split == SPLIT_OUT:
        fn = over_model_axis(_grouped_delta, in_specs=(rep, g, rep, heads_spec(3, 2), rep),
                             out_specs=heads_spec(2, 1))
        return fn(x, groups, a, b, scales)
    if split == SPLIT_IN:
        if context_model_axis_size() == 1:
            return _grouped_delta(x, groups, a, b, scales)
        body = lambda *args: _grouped_delta(*args, sum_axis=MODEL)
        fn = over_model_axis(body, in_specs=(heads_spec(2, 1), g, heads_spec(3, 1), rep, rep),
                             out_specs=rep)
        return fn(x, groups, a, b, scales)
    if split is not None:
        raise ValueError(f"split must be None, {SPLIT_IN!r} or {SPLIT_OUT!r}, got {split!r}")
    return _grouped_delta(x, groups, a, b, scales)


def dense_reference(x: jax.Array, slot_ids: jax.Array, a: jax.Array, b: jax.Array,
                    scales: jax.Array) -> jax.Array:
    """The same delta by gathering each token's whole matrices (for tests only: this is
    the per-token gather the grouped form avoids)."""
    h = jnp.einsum("TI,TIR->TR", x, a[slot_ids], precision="highest")
    return jnp.einsum("TR,TRO->TO", h * scales[slot_ids][:, None], b[slot_ids],
                      precision="highest")
