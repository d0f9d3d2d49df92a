"""The adapters' device layout: every target's A and B stacked in slots.

For each target (models/lora/targets.py) A [S, R, in_dim] (each slot's [r, in] as PEFT
stores it: the CPU reads all slots' A as one [S * R, in] matrix, ops._all_slots_add) and
B [S, R, out_dim], kept
in a tree shaped as the model's params (a scanned model's blocks stacked before the
slot axis, as its kernels are: the scan slices them with no copy), with
S = max_loras + 1 slots (slot 0 = no adapter: zeros) and R = max_lora_rank (a smaller
adapter's rank is padded with zeros, which adds nothing), plus each slot's scaling
float32[S]. The shapes depend only on the engine's settings, so loading, swapping or
mixing adapters never recompiles a step. A slot is written (write_slot) or zeroed
(clear_slot) in place: the stacks are donated, only that slot's rows are copied in.
Under a mesh A is split where its base kernel's input is, B where its output is
(stack_shardings), as ops.sharded_lora_delta expects.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.lora.ops import LORA, LORA_STEP, SPLIT_IN, SPLIT_OUT, group_by_slot
from models.lora.targets import LoRATarget
from sharding.mesh import MODEL

SCALES = "scales"   # the stacks' per-slot scaling leaf (beside the top-level module names)


def _paths(targets: dict[str, LoRATarget]) -> dict[tuple[str, ...], tuple[tuple[int, ...], LoRATarget]]:
    """Einsum module path -> (its stacked layer axes' sizes, one of its targets)."""
    last: dict = {}
    for t in targets.values():
        prev = last.get(t.path, (t.index, t))[0]
        last[t.path] = (tuple(max(p, i) for p, i in zip(prev, t.index)), t)
    return {path: (tuple(i + 1 for i in idx), t) for path, (idx, t) in last.items()}


def stack_shapes(targets: dict[str, LoRATarget], max_loras: int, max_rank: int, dtype: Any
                 ) -> dict:
    """The stacks as ShapeDtypeStructs (for the planner's bytes and ahead-of-time compiles):
    a tree shaped as the model's params (the Einsum module paths, models/lora/targets.py)
    with leaves "a" [*layers, S, R, in] and "b" [*layers, S, R, out] (*layers: a scanned
    model's stacked blocks, as its kernels have them), plus SCALES float32[S]."""
    s = max_loras + 1
    flat: dict = {(SCALES,): jax.ShapeDtypeStruct((s,), jnp.float32)}
    for path, (lead, t) in _paths(targets).items():
        flat[(*path, "a")] = jax.ShapeDtypeStruct((*lead, s, max_rank, t.in_dim), dtype)
        flat[(*path, "b")] = jax.ShapeDtypeStruct((*lead, s, max_rank, t.out_dim), dtype)
    return unflatten_dict(flat)


def stack_shardings(targets: dict[str, LoRATarget], mesh: Mesh) -> dict:
    """Each stack split as its base kernel: A on in_dim (row-parallel), B on out_dim
    (column-parallel); the rest replicated."""
    rep = NamedSharding(mesh, PartitionSpec())
    flat: dict = {(SCALES,): rep}
    for path, (lead, t) in _paths(targets).items():
        none = (None,) * (len(lead) + 1)
        flat[(*path, "a")] = (NamedSharding(mesh, PartitionSpec(*none, None, MODEL))
                              if t.split == SPLIT_IN else rep)
        flat[(*path, "b")] = (NamedSharding(mesh, PartitionSpec(*none, None, MODEL))
                              if t.split == SPLIT_OUT else rep)
    return unflatten_dict(flat)


def init_stacks(targets: dict[str, LoRATarget], max_loras: int, max_rank: int, dtype: Any,
                shardings: dict | None = None) -> dict:
    """All slots empty (zeros), placed by `shardings` (stack_shardings) when given."""
    shapes = stack_shapes(targets, max_loras, max_rank, dtype)
    zeros = lambda sds: jnp.zeros(sds.shape, sds.dtype)
    if shardings is None:
        return jax.jit(lambda: jax.tree_util.tree_map(zeros, shapes))()
    return jax.jit(lambda: jax.tree_util.tree_map(zeros, shapes), out_shardings=shardings)()


def target_stacks(stacks: dict, target: LoRATarget) -> tuple[jax.Array, jax.Array]:
    """One target's A [S, R, in] and B [S, R, out] out of the stacks."""
    node = stacks
    for key in target.path:
        node = node[key]
    if not target.index:
        return node["a"], node["b"]
    return node["a"][target.index], node["b"][target.index]


def slot_weights(weights: dict[str, tuple[np.ndarray, np.ndarray]], scaling: float,
                 targets: dict[str, LoRATarget], max_rank: int, dtype: Any) -> dict:
    """One adapter as one slot's rows of every stack (host numpy, the stacks' tree without
    their slot axis): its A [r, in] and B [r, out] (targets.adapter_weights) padded to
    max_rank, zeros for the targets it does not adapt."""
    unknown = weights.keys() - targets.keys()
    if unknown:
        raise ValueError(f"LoRA weights for unknown targets: {', '.join(sorted(unknown))[:200]}")
    flat: dict = {(SCALES,): np.float32(scaling)}
    for path, (lead, t) in _paths(targets).items():
        flat[(*path, "a")] = np.zeros((*lead, max_rank, t.in_dim), dtype)
        flat[(*path, "b")] = np.zeros((*lead, max_rank, t.out_dim), dtype)
    for name, (wa, wb) in weights.items():
        t = targets[name]
        flat[(*t.path, "a")][t.index][:wa.shape[0]] = wa
        flat[(*t.path, "b")][t.index][:wb.shape[0]] = wb
    return unflatten_dict(flat)


def _at_slot(row: Any) -> tuple:
    """The layer axes before a stack's slot axis, from one slot's row of it (a/b rows
    [*layers, x, y]; the scales' row is a scalar)."""
    return (slice(None),) * max(np.ndim(row) - 2, 0)


def set_slot(stacks: dict, slot: jax.Array, one: dict) -> dict:
    """stacks with slot `slot` set to `one` (slot_weights): write_slot's body, for a
    caller that jits it with its own shardings (the engine's runner)."""
    return jax.tree_util.tree_map(
        lambda s, w: s.at[(*_at_slot(w), slot)].set(w.astype(s.dtype)), stacks, one)


# The stacks are donated and updated in place; slot is traced: one compilation serves
# every slot.
write_slot = jax.jit(set_slot, donate_argnums=0)


@partial(jax.jit, donate_argnums=0)
def clear_slot(stacks: dict, slot: jax.Array) -> dict:
    """stacks with slot `slot` zeroed (no adapter), in place."""
    def clear(s: jax.Array) -> jax.Array:
        lead = (slice(None),) * max(s.ndim - 3, 0)
        return s.at[(*lead, slot)].set(jnp.zeros(s[(*lead, 0)].shape, s.dtype))
    return jax.tree_util.tree_map(clear, stacks)


def forward_variables(stacks: dict, slot_ids: jax.Array) -> dict:
    """The variable collections a forward takes to add each token's adapter delta:
        model.apply({"params": params, **forward_variables(stacks, slot_ids)}, ...)
    slot_ids int32[T]: each token's slot (0: no adapter, padding too). LORA: the stacks
    (shaped as the params, so a scanned model slices them per block as its kernels);
    LORA_STEP: the step's grouping (ops.group_by_slot, computed once here) and the
    scales, under every adapted module's path (flax scopes a module to its own path)."""
    groups = group_by_slot(slot_ids, stacks[SCALES].shape[0])
    step = {**groups._asdict(), SCALES: stacks[SCALES]}
    flat = flatten_dict({k: v for k, v in stacks.items() if k != SCALES})
    modules = {path[:-1] for path in flat}
    return {LORA: unflatten_dict(flat),
            LORA_STEP: unflatten_dict({(*m, k): v for m in modules for k, v in step.items()})}
