"""Compile a function for TPU on this CPU machine (libtpu's deviceless AOT compiler)."""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from sharding.tpu_targets import abstract_tpu_mesh


def compile_on_tpu(fn, *args: jax.ShapeDtypeStruct, target: str = "tpu-v6e",
                   mesh: str = "1x1", donate_argnums: tuple[int, ...] = ()):
    """fn jitted, lowered and compiled for `target` with every argument replicated on
    the abstract mesh; returns the compiled object (as_text, memory_analysis, ...)."""
    rep = NamedSharding(abstract_tpu_mesh(target, mesh), PartitionSpec())
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep) for a in args]
    return jax.jit(fn, donate_argnums=donate_argnums).lower(*placed).compile()
