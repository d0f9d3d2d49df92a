"""The batched LoRA op: every token's low-rank delta from its own adapter, in one step.

The adapters live stacked in S slots (slot 0 = no adapter, zeros; models/lora/slots.py):
A [S, R, I] (each slot's as PEFT stores it, [r, in]), B [S, R, O], padded to the rank R.
Tokens are sorted by slot once per step (group_by_slot), then each projection's delta is
two grouped matmuls over the sorted tokens (a ragged dot: each token's row meets only its
own slot's matrix, as Punica's SGMV and S-LoRA do) instead of gathering a whole matrix
per token. XLA:CPU has no grouped matmul worth the name; it runs one of two forms chosen
per step (_cpu_add): a loop over each adapter's windows of rows, or, for many adapters of
few rows each, one pass over every slot (A read as one [S * R, I] matrix: free in this
layout).

Under a mesh the delta follows its base projection (sharded_lora_add):
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

from pallas_kernels.sorted_search import bucket_of
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


def _grouped_add(y: jax.Array, x: jax.Array, groups: SlotGroups, a: jax.Array,
                 b: jax.Array, scales: jax.Array, sum_axis: str | None = None) -> jax.Array:
    """y [T, O] + delta, delta [T, O] = scale[s] * (x [T, I] @ A[s]^T) @ B[s], s the
    token's slot: by XLA's ragged dot where it is native (TPU, GPU), by _cpu_add on
    XLA:CPU, whose ragged dot runs every group over all the tokens (chosen when
    lowering). The delta is added in y's dtype."""
    return jax.lax.platform_dependent(
        y, x, groups, a, b, scales, cpu=partial(_cpu_add, sum_axis=sum_axis),
        default=partial(_ragged_add, sum_axis=sum_axis))


def _contract_a(ragged: bool = False):
    """Dimension numbers of x [T, I] against A [S, R, I] (ragged: grouped by S) or one
    slot's [R, I]: x's I with A's I, read in place (no transposed copy of the stack)."""
    dims = (((1,), (2,) if ragged else (1,)), ((), ()))
    if not ragged:
        return dims
    return jax.lax.RaggedDotDimensionNumbers(dims, lhs_ragged_dimensions=[0],
                                             rhs_group_dimensions=[0])


def _ragged_add(y: jax.Array, x: jax.Array, groups: SlotGroups, a: jax.Array, b: jax.Array,
                scales: jax.Array, sum_axis: str | None = None) -> jax.Array:
    xs = jnp.take(x, groups.order, axis=0)
    h = jax.lax.ragged_dot_general(xs.astype(a.dtype), a, groups.group_sizes, _contract_a(True),
                                   preferred_element_type=jnp.float32)  # [T, R]
    if sum_axis is not None:   # row-parallel: each device had a slice of I
        h = jax.lax.psum(h, sum_axis)
    h = h * jnp.take(scales.astype(jnp.float32), groups.token_slots)[:, None]
    d = jax.lax.ragged_dot(h.astype(b.dtype), b, groups.group_sizes,
                           preferred_element_type=jnp.float32)          # [T, O]
    # back to the tokens' order
    return y + jnp.take(d, groups.inverse, axis=0).astype(y.dtype)


# A window's iteration costs far more than its masked rows (rank-R dots): with one-row
# windows a 16-row decode step of one adapter ran 16 iterations per projection. A floor
# of 8 (docs/LORA.md, run 6): 1 adapter x1.22 -> x1.12, 4 adapters x1.29 -> x1.15.
MIN_CPU_WINDOW = 8


def cpu_window(num_tokens: int, num_slots: int) -> int:
    """Rows per window of the CPU form: the tokens an adapter gets when the step's are
    spread evenly over every slot, as a power of two in [MIN_CPU_WINDOW, 64] (at most T).
    Smaller windows waste fewer rows at each adapter's end, larger ones take fewer
    iterations."""
    t = max(MIN_CPU_WINDOW, num_tokens // max(num_slots - 1, 1))
    return min(64, 1 << (t.bit_length() - 1))


class _Windows(NamedTuple):
    """The CPU form's windows over the sorted tokens: each adapter's run of tokens
    (slot 0's skipped) cut into windows of `rows` rows, one slot per window."""
    rows: int
    count: jax.Array         # int32[]: windows in use this step
    ends: jax.Array          # int32[S]: cumulative windows per slot
    starts: jax.Array        # int32[S]: each slot's first sorted row
    sizes: jax.Array         # int32[S]: each slot's tokens (0 for slot 0)

    def at(self, k: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Window k: its slot, its first row (kept inside the T rows) and which of its
        rows are the slot's (the others belong to neighbours: masked)."""
        s = bucket_of(self.ends, k)
        per = (self.sizes + self.rows - 1) // self.rows
        first = self.starts[s] + (k - (self.ends[s] - per[s])) * self.rows
        end = jnp.minimum(first + self.rows, self.starts[s] + self.sizes[s])
        at = jnp.minimum(first, num_tokens - self.rows)
        row = at + jnp.arange(self.rows)
        return s, at, (row >= first) & (row < end)


def _windows(groups: SlotGroups, num_tokens: int, num_slots: int) -> _Windows:
    rows = min(cpu_window(num_tokens, num_slots), num_tokens)
    sizes = groups.group_sizes.at[0].set(0)
    ends = jnp.cumsum((sizes + rows - 1) // rows).astype(jnp.int32)
    starts = (jnp.cumsum(groups.group_sizes) - groups.group_sizes).astype(jnp.int32)
    return _Windows(rows, ends[-1], ends, starts, sizes)


def _windowed_add(y: jax.Array, x: jax.Array, groups: SlotGroups, a: jax.Array,
                  b: jax.Array, scales: jax.Array, sum_axis: str | None = None) -> jax.Array:
    """The CPU form: a loop over only the windows in use, each one slot's tokens (in
    sorted order) against that slot's A and B, so the work follows the adapter rows:
    about T_adapter x (I + O) x R plus one A and B read per window; a step with no
    adapter row does no LoRA work at all (the cond). Each window gathers its tokens'
    rows of x and adds its delta into theirs of y: no pass over all T rows (a sorted
    copy of x, a zeroed delta put back in order, then added: 20-40 % of the delta's
    time at 1,024 tokens on the 512-wide benchmark model)."""
    (T, _), (S, R, _) = x.shape, a.shape
    win = _windows(groups, T, S)
    a, b, scales = jnp.asarray(a), jnp.asarray(b), jnp.asarray(scales, jnp.float32)
    # Narrow stacks (--lora-dtype bfloat16) under wider activations: XLA:CPU has no
    # 16-bit arithmetic, so the window's matrices are widened (exactly) rather than the
    # activations rounded down to them; the stacks keep the bytes the flag asked for.
    # (16-bit stacks under 16-bit activations never get here: _cpu_add.)
    wide = jnp.promote_types(x.dtype, a.dtype)

    def window(k):   # window k: its slot, its tokens (positions in x) and which are its
        s, at, mask = win.at(k, T)
        return s, jax.lax.dynamic_slice_in_dim(groups.order, at, win.rows), mask

    def project_a(s, tokens, mask):   # the window's [rows, R] low-rank activations
        h = jax.lax.dot_general(jnp.take(x, tokens, axis=0).astype(wide), a[s].astype(wide),
                                _contract_a(), preferred_element_type=jnp.float32)
        return jnp.where(mask[:, None], h, 0.0)

    def project_b(s, h):
        return jnp.dot((h * scales[s]).astype(wide), b[s].astype(wide),
                       preferred_element_type=jnp.float32)

    def add(out, tokens, d):   # distinct tokens; the masked rows add zeros (exact)
        return out.at[tokens].add(d.astype(out.dtype), mode="promise_in_bounds",
                                  unique_indices=True)

    def fused():
        def body(k, out):
            s, tokens, mask = window(k)
            return add(out, tokens, project_b(s, project_a(s, tokens, mask)))
        return jax.lax.fori_loop(0, win.count, body, y)

    def low_rank():
        def body(k, h):
            s, tokens, mask = window(k)
            return add(h, tokens, project_a(s, tokens, mask))
        return jax.lax.fori_loop(0, win.count, body, jnp.zeros((T, R), jnp.float32))

    def expand(h):
        def body(k, out):
            s, tokens, mask = window(k)
            hk = jnp.where(mask[:, None], jnp.take(h, tokens, axis=0), 0.0)
            return add(out, tokens, project_b(s, hk))
        return jax.lax.fori_loop(0, win.count, body, y)

    busy = win.count > 0
    if sum_axis is None:
        return jax.lax.cond(busy, fused, lambda: y)
    # Row-parallel: each device holds a slice of I; the [T, R] partial products are
    # summed once between the two loops (the counts are replicated: same trip counts).
    h = jax.lax.cond(busy, low_rank, lambda: jnp.zeros((T, R), jnp.float32))
    return jax.lax.cond(busy, lambda: expand(jax.lax.psum(h, sum_axis)), lambda: y)


def _all_slots_add(y: jax.Array, x: jax.Array, groups: SlotGroups, a: jax.Array,
                   b: jax.Array, scales: jax.Array, sum_axis: str | None = None) -> jax.Array:
    """The CPU form for many adapters of few rows each: every token against every slot in
    two plain dots, A as one [S * R, I] matrix and B as one [S * R, O] (free reshapes of
    the stacks), each token keeping only its own slot's R products in between. Reads
    every slot's A and B once, in one parallel dot each, where the windowed form runs a
    loop iteration (and copies a slot's matrices out) per adapter; computes S times the
    low-rank products it needs, so it is for decode-sized steps (_cpu_add)."""
    (T, I), (S, R, _) = x.shape, a.shape
    h = jax.lax.dot_general(x.astype(a.dtype), a.reshape(S * R, I), _contract_a(),
                            preferred_element_type=jnp.float32)          # [T, S * R]
    if sum_axis is not None:   # row-parallel: each device had a slice of I
        h = jax.lax.psum(h, sum_axis)
    slot = groups.token_slots[groups.inverse]                            # in x's order
    own = jnp.arange(S)[None, :] == slot[:, None]                        # [T, S]
    h = jnp.where(own, scales.astype(jnp.float32)[None, :], 0.0)[:, :, None] * h.reshape(T, S, R)
    d = jnp.dot(h.reshape(T, S * R).astype(b.dtype), b.reshape(S * R, -1),
                preferred_element_type=jnp.float32)
    return y + d.astype(y.dtype)


# The all-slots form reads every slot once and computes T x S x R x (I + O) products;
# the windowed one computes only its rows' products but costs a loop iteration per
# window, and XLA:CPU copies the window's slot matrices out before each dot. Measured
# per projection (docs/LORA.md, runs 7-8; 17 slots, rank 16, Qwen3-8B's widths): float32
# stacks, 16 tokens: the windowed loop 0.47 ms with 2 windows and 3.0 ms with 16, the pass
# 0.76-0.95 ms whatever the adapters (the base dot: 4.3 ms); at 1,024 tokens the windowed
# loop cost less (a layer's projections x1.17-1.35 against x1.33-1.49); at 512 wide, where
# all the slots weigh as much as the base kernel, the pass never won. bfloat16 stacks
# under bf16 dots (a bf16 model on a CPU with native bf16 dots): the pass's dots are as
# fast as the base's and it beat the bf16 windows at every width and size measured, the
# heavy slots of k / v and of a 512-wide model included, so it runs in every such step.
ALL_SLOTS_MAX_TOKENS = 256        # float32 stacks
ALL_SLOTS_MIN_WINDOWS = 1 / 4     # windows in use per slot (float32 stacks)
ALL_SLOTS_MAX_WEIGHT = 1 / 4      # all slots' A and B against the base kernel, in elements (float32)


def _cpu_add(y: jax.Array, x: jax.Array, groups: SlotGroups, a: jax.Array, b: jax.Array,
             scales: jax.Array, sum_axis: str | None = None) -> jax.Array:
    """XLA:CPU's form, chosen per step: nothing without adapter rows; the all-slots pass
    where it can pay: for 16-bit stacks under activations of their dtype (the base dots'
    own: Einsum rounds the input for both) every step with adapter rows; for float32
    stacks (static) every slot's matrices at most ALL_SLOTS_MAX_WEIGHT of the base kernel
    and at most ALL_SLOTS_MAX_TOKENS tokens, and many windows (ALL_SLOTS_MIN_WINDOWS per
    slot or more: a cond on the step's count); else the windowed loop. Stacks narrower
    than the activations (--lora-dtype bfloat16 under a float32 model) take the windowed
    loop, which widens one slot at a time, not the whole stacks."""
    (T, I), (S, R, _), O = x.shape, a.shape, b.shape[-1]
    windowed = partial(_windowed_add, sum_axis=sum_axis)
    every = partial(_all_slots_add, sum_axis=sum_axis)
    narrow = jnp.dtype(a.dtype).itemsize < 4
    if jnp.promote_types(x.dtype, a.dtype) != a.dtype or (not narrow and (
            T > ALL_SLOTS_MAX_TOKENS or S * R * (I + O) > ALL_SLOTS_MAX_WEIGHT * I * O)):
        return windowed(y, x, groups, a, b, scales)
    count = _windows(groups, T, S).count
    pick = every if narrow else lambda *args: jax.lax.cond(
        count >= ALL_SLOTS_MIN_WINDOWS * S, every, windowed, *args)
    return jax.lax.cond(count > 0, pick, lambda y, *_: y, y, x, groups, a, b, scales)


def lora_delta(x: jax.Array, groups: SlotGroups, a: jax.Array, b: jax.Array,
               scales: jax.Array) -> jax.Array:
    """The LoRA delta of one projection for a batch mixing adapters.

    x [T, I] (the projection's input, contraction axes merged), groups from
    group_by_slot, a [S, R, I], b [S, R, O], scales float32[S] (alpha / r, or
    alpha / sqrt(r) with rsLoRA; anything for slot 0, whose matrices are zero).
    Returns [T, O] in x's dtype, to add to the base projection's output."""
    return sharded_lora_delta(x, groups, a, b, scales, None)


def sharded_lora_delta(x: jax.Array, groups: SlotGroups, a: jax.Array, b: jax.Array,
                       scales: jax.Array, split: str | None) -> jax.Array:
    """lora_delta under the context mesh's model axis, split as its base projection
    (sharded_lora_add)."""
    return sharded_lora_add(jnp.zeros((x.shape[0], b.shape[-1]), x.dtype), x, groups, a, b,
                            scales, split)


def sharded_lora_add(y: jax.Array, x: jax.Array, groups: SlotGroups, a: jax.Array,
                     b: jax.Array, scales: jax.Array, split: str | None) -> jax.Array:
    """y [T, O] (the base projection's output) plus lora_delta, under the context
    mesh's model axis, split as its base projection (module docstring): split "out": B,
    y and the result split on O; "in": x and A split on I, y and the result replicated;
    None: all replicated. Without a mesh (or one device on the model axis) this is
    y + lora_delta."""
    rep = PartitionSpec()
    g = SlotGroups(rep, rep, rep, rep)
    if split == SPLIT_OUT:
        out = heads_spec(2, 1)
        fn = over_model_axis(_grouped_add, in_specs=(out, rep, g, rep, heads_spec(3, 2), rep),
                             out_specs=out)
        return fn(y, x, groups, a, b, scales)
    if split == SPLIT_IN:
        if context_model_axis_size() == 1:
            return _grouped_add(y, x, groups, a, b, scales)
        body = lambda *args: _grouped_add(*args, sum_axis=MODEL)
        fn = over_model_axis(body, in_specs=(rep, heads_spec(2, 1), g, heads_spec(3, 2), rep,
                                             rep), out_specs=rep)
        return fn(y, x, groups, a, b, scales)
    if split is not None:
        raise ValueError(f"split must be None, {SPLIT_IN!r} or {SPLIT_OUT!r}, got {split!r}")
    return _grouped_add(y, x, groups, a, b, scales)


def dense_reference(x: jax.Array, slot_ids: jax.Array, a: jax.Array, b: jax.Array,
                    scales: jax.Array) -> jax.Array:
    """The same delta by gathering each token's whole matrices (for tests only: this is
    the per-token gather the grouped form avoids)."""
    h = jnp.einsum("TI,TRI->TR", x, a[slot_ids], precision="highest")
    return jnp.einsum("TR,TRO->TO", h * scales[slot_ids][:, None], b[slot_ids],
                      precision="highest")
