"""Abstract TPU meshes, for compiling TPU programs on a machine without a TPU.

libtpu's deviceless AOT compiler (jax.experimental.topologies) hands out device
descriptions of a TPU slice; `jax.jit(f).lower(...).compile()` on a mesh of them
runs the real XLA:TPU and Mosaic compilers, and `.memory_analysis()` gives the
per-device bytes. Needs libtpu (`pip install "jax[tpu]==<installed jax>"`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from jax.sharding import Mesh

from sharding.mesh import make_mesh, parse_mesh


@dataclass(frozen=True)
class TpuTarget:
    generation: str          # libtpu's topology prefix
    hbm_bytes: int           # per chip, as published
    hbm_gbps: float          # per chip, as published (GB/s)
    usable_hbm_bytes: int    # what XLA:TPU lets one program use (the rest is the runtime's)
    bf16_tflops: float       # per chip, as published (dense bf16 matmul peak)


# Published per-chip figures (cloud.google.com/tpu/docs/system-architecture-tpu-vm);
# usable: the "available HBM" libtpu's compiler states when a program does not fit.
TPU_TARGETS = {
    "tpu-v5e": TpuTarget("v5e", 16 * 2**30, 819.0, int(15.75 * 2**30), 197.0),
    "tpu-v6e": TpuTarget("v6e", 32 * 2**30, 1640.0, int(31.25 * 2**30), 918.0),
    "tpu-v5p": TpuTarget("v5p", 95 * 2**30, 2765.0, int(95.74 * 2**30), 459.0),
}

# Chips -> a slice layout libtpu accepts (v5p slices are 3-D).
_LAYOUTS = {1: ("1x1", "1x1x1"), 4: ("2x2", "2x2x1"), 8: ("2x4", "2x2x2"),
            16: ("4x4", "2x2x4")}


def tpu_target(name: str) -> TpuTarget:
    if name not in TPU_TARGETS:
        raise ValueError(f"target {name!r}: expected one of {tuple(TPU_TARGETS)}")
    return TPU_TARGETS[name]


def abstract_tpu_mesh(target: str, mesh: str = "1x1") -> Mesh:
    """A ("data", "model") mesh of D x M abstract chips of `target` (e.g. "tpu-v6e")."""
    from jax.experimental import topologies
    # libtpu takes a host-wide lock (/tmp/libtpu_lockfile) that guards real chips; a
    # deviceless compile touches none, and several may run on one host at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    gen = tpu_target(target).generation
    d, m = parse_mesh(mesh)
    if d * m not in _LAYOUTS:
        raise ValueError(f"mesh {mesh}: abstract TPU slices of {sorted(_LAYOUTS)} chips only")
    layout = _LAYOUTS[d * m][1 if gen == "v5p" else 0]
    kw = {"chips_per_host_bounds": (1, 1, 1)} if d * m == 1 else {}
    topo = topologies.get_topology_desc(platform="tpu", topology_name=f"{gen}:{layout}", **kw)
    return make_mesh((d, m), devices=topo.devices)
