"""Compile a function for TPU on this CPU machine (libtpu's deviceless AOT compiler)."""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from sharding.tpu_targets import abstract_tpu_mesh   # also lifts libtpu's host lock


def compile_on_tpu(fn, *args: jax.ShapeDtypeStruct, target: str = "tpu-v6e",
                   mesh: str = "1x1", donate_argnums: tuple[int, ...] = (),
                   specs: tuple[PartitionSpec, ...] | None = None):
    """fn jitted, lowered and compiled for `target` on the abstract mesh, every argument
    replicated unless `specs` gives its PartitionSpec; fn is traced under that mesh
    (jax.set_mesh), so shard_map over it works. Returns the compiled object
    (as_text, memory_analysis, cost_analysis, ...)."""
    abstract = abstract_tpu_mesh(target, mesh)
    specs = specs or (PartitionSpec(),) * len(args)
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(abstract, s))
              for a, s in zip(args, specs, strict=True)]
    with jax.set_mesh(abstract):
        return jax.jit(fn, donate_argnums=donate_argnums).lower(*placed).compile()


def hlo_lines(hlo: str) -> list[str]:
    """The compiled program's text, one instruction per line: a Pallas kernel's metadata
    (kernel_metadata={...}) spans several lines, joined here to its instruction's."""
    out: list[str] = []
    for line in hlo.splitlines():
        if out and line and line.rstrip() != "}" and not line.startswith(
                ("  ", "%", "ENTRY", "HloModule")):
            out[-1] += line.strip()
        else:
            out.append(line)
    return out
