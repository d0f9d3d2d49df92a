"""The adapters' device layout: every target's A and B stacked in slots.

For each target (models/lora/targets.py) A [S, in_dim, R] and B [S, R, out_dim], with
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.lora.ops import SPLIT_IN, SPLIT_OUT
from models.lora.targets import LoRATarget
from sharding.mesh import MODEL

SCALES = "scales"   # the stacks' per-slot scaling leaf (a target's name has dots, never this)


def stack_shapes(targets: dict[str, LoRATarget], max_loras: int, max_rank: int, dtype: Any
                 ) -> dict:
    """The stacks as ShapeDtypeStructs (for the planner's bytes and ahead-of-time compiles)."""
    s = max_loras + 1
    tree: dict = {SCALES: jax.ShapeDtypeStruct((s,), jnp.float32)}
    for name, t in targets.items():
        tree[name] = {"a": jax.ShapeDtypeStruct((s, t.in_dim, max_rank), dtype),
                      "b": jax.ShapeDtypeStruct((s, max_rank, t.out_dim), dtype)}
    return tree


def stack_shardings(targets: dict[str, LoRATarget], mesh: Mesh) -> dict:
    """Each stack split as its base kernel: A on in_dim (row-parallel), B on out_dim
    (column-parallel); the rest replicated."""
    rep = NamedSharding(mesh, PartitionSpec())
    tree: dict = {SCALES: rep}
    for name, t in targets.items():
        tree[name] = {
            "a": NamedSharding(mesh, PartitionSpec(None, MODEL, None)) if t.split == SPLIT_IN else rep,
            "b": NamedSharding(mesh, PartitionSpec(None, None, MODEL)) if t.split == SPLIT_OUT else rep}
    return tree


def init_stacks(targets: dict[str, LoRATarget], max_loras: int, max_rank: int, dtype: Any,
                shardings: dict | None = None) -> dict:
    """All slots empty (zeros), placed by `shardings` (stack_shardings) when given."""
    shapes = stack_shapes(targets, max_loras, max_rank, dtype)
    zeros = lambda sds: jnp.zeros(sds.shape, sds.dtype)
    if shardings is None:
        return jax.jit(lambda: jax.tree_util.tree_map(zeros, shapes))()
    return jax.jit(lambda: jax.tree_util.tree_map(zeros, shapes), out_shardings=shardings)()


def slot_weights(weights: dict[str, tuple[np.ndarray, np.ndarray]], scaling: float,
                 targets: dict[str, LoRATarget], max_rank: int, dtype: Any) -> dict:
    """One adapter as one slot's rows of every stack (host numpy): its A [in, r] and
    B [r, out] (targets.adapter_weights) padded to max_rank, zeros for the targets it
    does not adapt."""
    tree: dict = {SCALES: np.float32(scaling)}
    for name, t in targets.items():
        a = np.zeros((t.in_dim, max_rank), dtype)
        b = np.zeros((max_rank, t.out_dim), dtype)
        if name in weights:
            wa, wb = weights[name]
            a[:, :wa.shape[1]] = wa
            b[:wb.shape[0]] = wb
        tree[name] = {"a": a, "b": b}
    unknown = weights.keys() - targets.keys()
    if unknown:
        raise ValueError(f"LoRA weights for unknown targets: {', '.join(sorted(unknown))[:200]}")
    return tree


@partial(jax.jit, donate_argnums=0)
def write_slot(stacks: dict, slot: jax.Array, one: dict) -> dict:
    """stacks with slot `slot` set to `one` (slot_weights); the stacks are donated and
    updated in place. slot is traced: one compilation serves every slot."""
    return jax.tree_util.tree_map(lambda s, w: s.at[slot].set(w.astype(s.dtype)), stacks, one)


@partial(jax.jit, donate_argnums=0)
def clear_slot(stacks: dict, slot: jax.Array) -> dict:
    """stacks with slot `slot` zeroed (no adapter), in place."""
    return jax.tree_util.tree_map(lambda s: s.at[slot].set(jnp.zeros(s.shape[1:], s.dtype)), stacks)
